"""Check suites as data (checks/*.toml), `k3verify all` (plan, resumable run, combined report,
verdict per toggle) and the release sign-off."""
