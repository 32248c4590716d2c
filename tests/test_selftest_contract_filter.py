"""The selftest's `contract` option: the GPU release suite judges exact entries on k3-mini and
approx ones (toggles and mutants, drift budgets) on the trained golden/k3-dims."""
import pytest

from k3verify.kinds import plan
from k3verify.errors import UsageError
from k3verify.kinds.base import CheckSpec
from k3verify.suites.suite import load_suite
from optimized_stack import toggles as registry


def planned(**options) -> dict[str, str]:
    return {u.toggle: registry.get(u.toggle).contract.kind for u in plan(CheckSpec("selftest", options=options))}


def test_each_contract_plans_only_its_entries_and_all_plans_both():
    everything, exact, approx = planned(), planned(contract="exact"), planned(contract="approx")
    assert set(exact.values()) == {"exact"} and set(approx.values()) == {"approx"}
    assert set(exact) | set(approx) == set(everything) and not set(exact) & set(approx)
    # the entries the second H200 run could not judge on k3-mini are among the approx ones, mutants too
    assert {"kda_state_bf16", "mut_mla_sdpa_mask_leaks_next", "mut_mla_absorbed_decode_scale",
            "mla_absorbed", "kda_chunked"} <= set(approx)
    assert {"batched_decode", "mut_kda_decay_after_delta"} <= set(exact)


def test_the_filter_composes_with_toggles():
    got = planned(toggles=["mla_absorbed", "batched_decode"], contract="approx")
    assert "mla_absorbed" in got and "batched_decode" not in got
    assert {n for n in got if registry.get(n).kind == "mutant"} >= {"mut_mla_absorbed_scale"}


def test_an_unknown_contract_is_a_one_line_option_error():
    with pytest.raises(UsageError, match="--contract must be one of all, exact, approx"):
        CheckSpec("selftest", options={"contract": "bitwise"})


def test_the_gpu_release_suite_splits_the_contracts_between_its_models():
    suite = load_suite("release", device="cuda")
    selftests = {c.name: (c.model, c.options["contract"]) for c in suite.checks if c.kind == "selftest"}
    assert selftests["exact-contracts"] == (None, "exact")
    assert selftests["approx-contracts-k3-dims"] == ("golden/k3-dims", "approx")
