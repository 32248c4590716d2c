"""The check kinds (selftest, diff, drift, golden, gsm8k, needle, kvv, bench): plan(spec) -> units,
run(unit, ctx) -> results; the CLI commands and `k3verify all` both go through them."""
