"""The OpenAI-compatible public gateway (DESIGN §1 steps 1-5): keys and teams, quotas with
reserve-then-settle in the store, tiers, routing to prefill/decode nodes (coordinator, static
lists or etcd), usage records. Never imports torch or engine/.

Packages, from the bottom up (a module imports only from its own layer or the ones below;
tests/test_layering.py holds the order):

- tools/: tool-call formats, parsers and prompts (no other gateway import);
- backends/providers/: the commercial API clients (retries, breakers, fallback chains, auto);
- config*.py, metrics.py: gateway.toml's tables and checks, the Prometheus registry;
- serving/requests.py, constraint.py, features.py: the checked request every layer reads;
- accounts/: who calls (auth, keys), what they may spend (the store, team gate), what they
  spent (ledger, usage writer, heartbeat);
- backends/: the seams (base.py) and who answers behind them (cluster/, provider, embedding);
- serving/: the one request pipeline (parse → choose → measure → reserve → attempt → settle);
- state.py: the shared state, built complete by `open_state`;
- batch/: the Files/Batches API and its runner; api/: the public HTTP APIs; console/;
- app.py, server.py: the composition root and the process.
"""
