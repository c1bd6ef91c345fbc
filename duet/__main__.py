"""`python -m duet` is the `duet` command."""

from duet.cli import main

# Guarded: vLLM starts its engine core with multiprocessing's spawn, which re-imports this
# module in the child as __mp_main__; an unguarded main() would start a second duet there.
if __name__ == "__main__":
    raise SystemExit(main())
