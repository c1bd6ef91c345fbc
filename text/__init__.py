"""Text on the way in and out of a model, without torch: the tokenizer and chat template
wrapper, incremental detokenization, and structured-output guides (their checks, their
compilation with the grammar engine, and the bounds on the JSON they accept).

Invariant: importing anything here never imports torch (the gateway computes prompt ids and
checks guides with it; `tests/runtime/test_no_torch.py` checks `sys.modules`).
"""
