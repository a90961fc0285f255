"""Capability check (roformer.capability): corpus rules, probes, bounds, the whole check at smoke size."""
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from roformer import capability
from roformer.ablation import plan
from roformer.data.tokenizer import WordPieceTokenizer
from roformer.model import ModelConfig, RoFormerForMaskedLM


def smoke_config():
    return plan.load_config_file("capability", "smoke")


def test_direction_rule_is_one_cycle_so_forward_and_backward_answers_differ():
    world = capability.World.draw(0, 64, 8)
    seen, x = [], 0
    for _ in range(64):
        seen.append(x)
        x = world.cycle[x]
    assert sorted(seen) == list(range(64)) and x == 0   # a single cycle through every symbol
    inverse = np.argsort(world.cycle)
    assert np.all(world.cycle != inverse)               # g(c) != g^-1(c): no 2-cycles
    assert sorted(world.pair_map) == list(range(64))    # f is a bijection


def test_documents_follow_the_rules_and_name_their_probe_slots():
    config = smoke_config()
    world = capability.World.draw(0, config.corpus.num_symbols, config.corpus.num_fillers)
    rng = np.random.default_rng(0)
    for task, words, slots in capability.documents(rng, world, config.corpus, 40):
        if task == "pairs":
            assert len(slots) == config.corpus.pairs_per_doc
            for slot in slots:
                key = int(words[slot - 1][1:])
                assert words[slot] == f"v{world.pair_map[key]}"
        else:
            x, y = slots
            assert y == x + 1 and words[y] == f"d{world.cycle[int(words[x][1:])]}"
            assert all(w.startswith("w") for i, w in enumerate(words) if i not in (x, y))


@pytest.fixture(scope="module")
def probe_setup(tmp_path_factory):
    config = smoke_config()
    vocab, _ = capability.write_corpus(config, tmp_path_factory.mktemp("corpus"))
    tokenizer = WordPieceTokenizer.from_vocab_file(vocab)
    return config, tokenizer, capability.probe_batches(config, tokenizer, 64)


def test_probes_mask_every_value_of_a_pairs_document_and_one_end_of_each_direction_triple(probe_setup):
    config, tokenizer, batches = probe_setup
    pairs, direction = batches["pairs"], batches["direction"]
    assert (pairs["input_ids"] == tokenizer.mask_id).sum(axis=1).tolist() == [config.corpus.pairs_per_doc] * len(
        pairs["input_ids"])
    assert (direction["input_ids"] == tokenizer.mask_id).sum(axis=1).tolist() == [1] * len(direction["input_ids"])
    world = capability.World.draw(config.seed, config.corpus.num_symbols, config.corpus.num_fillers)
    d = {tokenizer.encode_ids([f"d{i}"])[0][0]: i for i in range(config.corpus.num_symbols)}
    slots = direction["masked_positions"][:, 0]
    rows = np.arange(len(slots))
    # Even documents mask x (its answer's image g(x) follows), odd ones y (g^-1(y) precedes).
    answers = [d[a] for a in direction["answers"][:, 0]]
    right = [d[t] for t in direction["input_ids"][rows[::2], slots[::2] + 1]]
    left = [d[t] for t in direction["input_ids"][rows[1::2], slots[1::2] - 1]]
    assert right == [world.cycle[a] for a in answers[::2]]
    assert [world.cycle[t] for t in left] == answers[1::2]
    # The mirrored document's answer: the neighbour's image on the other side, never the answer.
    mirrors = [d[m] for m in direction["mirror_answers"][:, 0]]
    assert mirrors[::2] == [world.cycle[t] for t in right]
    assert [world.cycle[m] for m in mirrors[1::2]] == left
    assert all(m != a for m, a in zip(mirrors, answers))


def test_a_model_without_positions_cannot_beat_one_in_n_on_pairs(probe_setup):
    config, tokenizer, batches = probe_setup
    model_config = ModelConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size, position="none",
                                           hidden_dropout=0.0, attention_dropout=0.0)
    params = nnx.state(RoFormerForMaskedLM(model_config, rngs=nnx.Rngs(3)), nnx.Param)
    batch = batches["pairs"]
    predictions = np.asarray(capability._predict(model_config)(params, batch["input_ids"], batch["masked_positions"]))
    assert np.all(predictions == predictions[:, :1])   # the same prediction at every [MASK] of a document
    assert capability.probe_accuracy(model_config, params, batch) <= capability.bag_of_words_bound(config)["pairs"]


def test_an_oracle_scores_one_so_the_probe_can_be_passed(probe_setup, monkeypatch):
    _, _, batches = probe_setup
    batch = batches["pairs"]
    answers = {ids.tobytes(): row for ids, row in zip(batch["input_ids"], batch["answers"])}
    monkeypatch.setattr(capability, "_predict", lambda _: lambda params, ids, slots: np.stack(
        [answers[row.tobytes()] for row in ids]))
    assert capability.probe_accuracy(None, None, batch) == 1.0


@pytest.mark.parametrize("change, message", [
    (lambda c: setattr(c, "schemes", ("rope", "rotery")), "unknown scheme 'rotery'"),
    (lambda c: setattr(c, "expect_fail", "alibi:order"), "config.expect_fail item 'alibi:order'"),
    (lambda c: setattr(c, "threshold", 1.5), "config.threshold=1.5"),
    (lambda c: setattr(c.pretrain.train, "seq_len", 16), "pretrain.train.seq_len=16 is shorter"),
])
def test_a_bad_config_is_refused_before_anything_is_written(tmp_path, change, message):
    config = smoke_config()
    change(config)
    with pytest.raises(ValueError, match=message):
        capability.run_capability(config, tmp_path / "check")
    assert not (tmp_path / "check").exists()


@pytest.mark.slow
def test_the_whole_check_at_smoke_size_writes_its_table_and_resumes(tmp_path, monkeypatch):
    config = smoke_config()
    config.pretrain.mesh.num_devices = 1   # one of the 8 virtual test devices: a smaller program
    result = capability.run_capability(config, tmp_path / "check")
    saved = json.loads((tmp_path / "check" / capability.RESULT_JSON).read_text())
    assert [r["scheme"] for r in saved["schemes"]] == ["rope", "none"]
    for row in saved["schemes"]:
        assert [p["step"] for p in row["curve"]] == [10, 20]
        assert all(0.0 <= p[t] <= 1.0 for p in row["curve"] for t in (*capability.TASKS, capability.MIRROR))
    none = saved["schemes"][1]
    assert none["expected_pass"] == {"pairs": False, "direction": False}
    assert none["accuracy"]["pairs"] <= 1 / config.corpus.pairs_per_doc
    assert "| rope |" in (tmp_path / "check" / capability.RESULT_MD).read_text()
    # The command's last line names outputs that exist.
    named = [word.rstrip(",") for word in capability.done_line(str(tmp_path / "check")).split()
             if word.startswith(str(tmp_path))]
    assert len(named) == 4 and all(Path(p.replace("<scheme>", "rope")).exists() for p in named), named
    # A rerun trains nothing and probes nothing again.
    monkeypatch.setattr(capability, "probe_accuracy", lambda *a, **k: pytest.fail("probed again"))
    assert capability.run_capability(config, tmp_path / "check")["schemes"] == result["schemes"]


def test_a_preempted_scheme_stops_the_check_before_the_next_scheme(tmp_path, monkeypatch):
    import roformer.train

    trained = []

    def preempted(cfg, workdir):
        trained.append(workdir.name)
        return {"preempted": True, "final_step": 7}

    monkeypatch.setattr(roformer.train, "train_and_evaluate", preempted)
    result = capability.run_capability(smoke_config(), tmp_path / "check")
    assert result["preempted"] and result["schemes"] == [] and trained == ["rope"]
    assert not (tmp_path / "check" / capability.RESULT_JSON).exists()


def fake_row(scheme: str, pairs: float, direction: float, steps=(10, 20), diverged=False) -> dict:
    return {"scheme": scheme, "diverged": diverged, "final_eval_loss": 5.0,
            "curve": [{"step": s, "pairs": pairs, "direction": direction, capability.MIRROR: 0.3} for s in steps]}


def test_the_smoke_variant_is_a_pipeline_check_with_its_own_expectations():
    """20 steps teach no scheme a rule: the smoke check passes when every scheme trained to the
    last step and was probed and `none` stayed within its bounds, whatever rope learned."""
    config = smoke_config()
    schemes = capability.validate(config)
    result = capability._result(config, schemes, [fake_row("rope", 0.1, 0.4), fake_row("none", 0.12, 0.5)])
    assert result["all_as_expected"] and result["judge"] == "pipeline"
    assert "A pipeline check" in capability.to_markdown(result)
    for rows in ([fake_row("rope", 0.1, 0.4), fake_row("none", 0.2, 0.5)],           # none above 1/8 on pairs
                 [fake_row("rope", 0.1, 0.4, steps=(10,)), fake_row("none", 0.1, 0.5)],   # never reached step 20
                 [fake_row("rope", 0.1, 0.4, diverged=True), fake_row("none", 0.1, 0.5)],
                 [fake_row("rope", 0.1, 0.4)]):                                        # a scheme missing
        assert not capability._result(config, schemes, rows)["all_as_expected"]
    # On `direction` `none` is held to 0.5 only on average: 40 probe documents allow 3 binomial
    # standard errors (0.74 here), while `pairs` stays exact.
    assert capability._result(config, schemes, [fake_row("rope", 0.1, 0.4),
                                                fake_row("none", 0.12, 0.7)])["all_as_expected"]
    assert not capability._result(config, schemes, [fake_row("rope", 0.1, 0.4),
                                                    fake_row("none", 0.12, 0.8)])["all_as_expected"]
    # The full check still judges the schemes: rope failing both rules is not as expected there.
    full = plan.load_config_file("capability")
    assert not capability._result(full, ["rope"], [fake_row("rope", 0.1, 0.4, steps=(2500,))])["all_as_expected"]
    # ALiBi failing both tasks (the tiny preset's 2 heads, and symmetry) is as expected.
    assert capability._result(full, ["alibi"], [fake_row("alibi", 0.12, 0.48, steps=(2500,))])["all_as_expected"]


def test_probe_documents_are_not_in_the_training_text():
    """The full check's training text holds `direction` documents without filler (a few of the
    16 there are); the probes hold none of them, nor any other training document."""
    config = plan.load_config_file("capability")
    world = capability.World.draw(config.seed, config.corpus.num_symbols, config.corpus.num_fillers)
    seen = set(capability.training_texts(config, world))
    assert sum(len(text.split()) == 2 for text in seen) > 0
    probes = capability.probe_documents(config, world)
    assert {task: len(rows) for task, rows in probes.items()} == {t: config.corpus.probe_docs for t in capability.TASKS}
    assert not [words for rows in probes.values() for words, _ in rows if " ".join(words) in seen]
