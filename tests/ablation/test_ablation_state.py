"""The ablation's stage records (roformer.ablation.state): the one status rule, and the
state file read back as written."""
import json

import pytest

from roformer.ablation.state import STATE_FILE, AblationState, combined_status, run_status


pytestmark = pytest.mark.fast   # the fast lane (docs/testing.md)

def test_one_rule_gives_the_status_of_a_run_and_of_a_scheme_over_its_seeds():
    assert combined_status(["done", "done"]) == "done"
    assert combined_status(["done", None]) == "pending"
    assert combined_status(["done", "failed", None]) == "failed"
    assert combined_status(["done", None], "1/2 seeds") == "1/2 seeds"
    stages = ["pretrain", "extrapolation", "glue"]
    records = {"pretrain": {"status": "done"}, "extrapolation": {"status": "failed", "error": "RuntimeError: x"},
               "glue": {"status": "failed", "error": "ValueError: y"}}
    assert run_status(records, stages) == {"status": "failed", "failed_stage": "extrapolation",
                                           "error": "RuntimeError: x"}
    assert run_status({"pretrain": {"status": "done"}, "extrapolation": {}, "glue": {}}, stages) == \
        {"status": "pending"}
    assert run_status({s: {"status": "done"} for s in stages}, stages) == {"status": "done"}


def test_state_file_is_replaced_whole_and_read_back(tmp_path):
    state = AblationState(tmp_path)
    record = {"status": "done", "fingerprint": "abc", "wall_s": 1.0, "result": {"steps": 3}}
    state.set("rope/seed0", "pretrain", record)
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"rope/seed0": {"pretrain": record}}
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]   # no staging file left behind
    again = AblationState(tmp_path)
    assert again.is_done("rope/seed0", "pretrain", "abc") and not again.is_done("rope/seed0", "pretrain", "abd")
    assert again.get("rope/seed0", "glue") == {}
