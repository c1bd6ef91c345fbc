"""Small measurement probes behind figures in docs/benchmarks.md that the main benches do not
print (one kernel against another, where a prefill's time goes). Each is `python -m
bench.probes.NAME --help`; none is run by the tests."""
