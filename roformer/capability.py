"""Capability check: can each position scheme learn to use word order, and direction, when
that is all a task needs? Trained from scratch with the project's own loop.

    python -m roformer.capability --config=configs/capability.py --workdir=DIR

One synthetic corpus holds two kinds of document (words are made-up symbols):

  pairs      `k12 v40 and k3 v7 and ... k51 v2`: n key-value pairs with distinct keys, each
             value fixed by its key through one random bijection f of the world. Probe: every
             value of a held-out document masked at once. The answer at a slot is f of the
             key beside it. A model without positions (`none`) is permutation-equivariant:
             every [MASK] of a document looks the same to it, so it predicts the same token at
             all n slots and can be right at most once: accuracy <= 1/n. The rule needs no
             sense of direction (a value's neighbours are its key and `and`), so every scheme
             that sees order, symmetric ones included, can solve it.
  direction  filler words, then `x y`, then filler, with y = g(x) for one random cyclic
             permutation g and the filler lengths drawn independently. Probe: x masked in half
             the documents, y in the other half. Reversing a document whose y is masked gives
             one whose x is masked, with the same neighbours in mirror image, but the answers
             differ (g(c) against g^-1(c), never equal since g has no 2-cycles). A scheme
             whose outputs reverse with its input (symmetric ALiBi, and `none`) gives both the
             same prediction, so it is right at most half the time; a scheme that tells left
             from right can be right every time. (`none` does find x's partner: it is the
             document's only other d-symbol; it cannot find its side.) The bound holds for
             `none` on average over documents (a finite probe set can show a little more).
             The [CLS] and [SEP] at the ends are different words, so a symmetric scheme can
             still read a side from them: in one step where the masked word's distances to the
             two ends settle it (next to an end, or with the most filler on one side: 25 of
             169 filler-length pairs, worth up to 0.574 accuracy), in two steps elsewhere
             (distances to [CLS], then their comparison); ALiBi is held below the threshold in
             practice, not by a theorem (docs/capability.md gives the numbers). x and y are neighbours, as a key and its value
             are: attending to the neighbour already pays before the rule is known (it says
             the masked word is a d-symbol), so the rule is learned along a gradual path.
             With a word between them (`x q y`) that first step points at the middle word
             and nothing rewards looking two words away until g is known: in trials no scheme
             learned it in 1,500 steps.

Each scheme trains on the same corpus, vocabulary, seed and recipe (`config.pretrain`: the
reference comparison's, at sequence 32); the probes, documents the training text does not
hold, run on every checkpoint. The report gives, per scheme and task, the final accuracy,
the bound a bag of words cannot pass, the first step at which the accuracy reached the
threshold, and pass/fail against `config.expect_fail` (ALiBi is expected to fail
`direction`, being symmetric, and `pairs` with the `tiny` preset's 2 heads, whose slopes let
no head prefer an adjacent word); the smoke variant is a pipeline check instead
(`config.judge`, JUDGES). Resumable: finished runs
and probed checkpoints are skipped.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags
from flax import nnx

from roformer import cli, train, workdir_kind
from roformer.ablation import plan
from roformer.data.tokenizer import SPECIAL_TOKENS
from roformer.errors import ConfigError
from roformer.files import write_text_atomic
from roformer.model import RoFormerForMaskedLM
from roformer.workdir import PretrainWorkdir
from roformer.train.config import arm_model_keys
from roformer.workdir_lock import workdir_lock

log = logging.getLogger("roformer.capability")

TASKS = ("pairs", "direction")
# Per probed step also: how often `direction` predicts the mirrored document's answer.
MIRROR = "direction_mirror"
RESULT_JSON = "capability.json"
RESULT_MD = "capability.md"
# What a run is judged by (config.judge): "schemes", each scheme passes or fails each task as
# expected; "pipeline", a budget too small for any scheme to learn a rule (the smoke variant):
# every scheme trained to the last step, every checkpoint was probed, and `none` stayed within
# the bounds no budget lets it pass.
JUDGES = ("schemes", "pipeline")


# --------------------------------------------------------------------------- the world


@dataclasses.dataclass(frozen=True)
class World:
    """The fixed rules every document follows (drawn once from the corpus seed)."""

    pair_map: np.ndarray       # f: key index -> value index (a bijection)
    cycle: np.ndarray          # g: symbol index -> symbol index (one cycle through every symbol)
    num_fillers: int

    @classmethod
    def draw(cls, seed: int, num_symbols: int, num_fillers: int) -> "World":
        rng = np.random.default_rng(seed)
        pair_map = rng.permutation(num_symbols)
        order = rng.permutation(num_symbols)
        cycle = np.empty(num_symbols, dtype=np.int64)
        cycle[order] = np.roll(order, -1)   # order[i] -> order[i + 1]: a single cycle
        return cls(pair_map, cycle, num_fillers)

    @property
    def words(self) -> list[str]:
        n = len(self.pair_map)
        return ([f"k{i}" for i in range(n)] + [f"v{i}" for i in range(n)] + [f"d{i}" for i in range(n)]
                + [f"w{i}" for i in range(self.num_fillers)] + ["and"])


def pairs_document(rng: np.random.Generator, world: World, num_pairs: int) -> tuple[list[str], list[int]]:
    """Words of one `pairs` document and the indices of its values (the probe's slots)."""
    keys = rng.choice(len(world.pair_map), size=num_pairs, replace=False)
    words, slots = [], []
    for i, key in enumerate(keys):
        if i:
            words.append("and")
        words.append(f"k{key}")
        slots.append(len(words))
        words.append(f"v{world.pair_map[key]}")
    return words, slots


def direction_document(rng: np.random.Generator, world: World, max_filler: int) -> tuple[list[str], list[int]]:
    """Words of one `direction` document and the indices of x and y (adjacent)."""
    x = int(rng.integers(len(world.cycle)))
    left, right = rng.integers(0, max_filler + 1, size=2)
    filler = lambda n: [f"w{i}" for i in rng.integers(world.num_fillers, size=n)]  # noqa: E731
    words = filler(left) + [f"d{x}", f"d{world.cycle[x]}"] + filler(right)
    return words, [int(left), int(left) + 1]


def document(rng: np.random.Generator, world: World, corpus: ml_collections.ConfigDict, task: str
             ) -> tuple[str, list[str], list[int]]:
    """One document of `task`: (task, words, probe slots)."""
    if task == "pairs":
        return task, *pairs_document(rng, world, corpus.pairs_per_doc)
    return task, *direction_document(rng, world, corpus.max_filler)


def documents(rng: np.random.Generator, world: World, corpus: ml_collections.ConfigDict, count: int
              ) -> list[tuple[str, list[str], list[int]]]:
    """`count` training documents: one `pairs` document, then `corpus.direction_per_pairs`
    `direction` ones, and again. A pairs document holds pairs_per_doc examples of its rule,
    a direction document one, so the direction rule needs more documents to be seen as often."""
    cycle = 1 + corpus.direction_per_pairs
    return [document(rng, world, corpus, "pairs" if i % cycle == 0 else "direction") for i in range(count)]


def write_corpus(config: ml_collections.ConfigDict, directory: Path) -> tuple[Path, Path]:
    """vocab.txt (the special tokens, then every word) and train.txt (documents separated by
    blank lines) in `directory`; rewritten only when missing, so a resumed check reads the
    same files."""
    corpus = config.corpus
    world = World.draw(config.seed, corpus.num_symbols, corpus.num_fillers)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, text = directory / "vocab.txt", directory / "train.txt"
    if not vocab.is_file():
        write_text_atomic(vocab, "".join(f"{w}\n" for w in (*SPECIAL_TOKENS, *world.words)))
    if not text.is_file():
        write_text_atomic(text, "\n\n".join(training_texts(config, world)) + "\n")
    return vocab, text


def training_texts(config: ml_collections.ConfigDict, world: World) -> list[str]:
    """The training documents' texts, in order (the same for a seed on every call)."""
    rng = np.random.default_rng([config.seed, 1])
    return [" ".join(words) for _, words, _ in documents(rng, world, config.corpus, config.corpus.train_docs)]



# --------------------------------------------------------------------------- probes


def probe_batches(config: ml_collections.ConfigDict, tokenizer, seq_len: int) -> dict[str, dict]:
    """Per task, a held-out probe set (documents the training text does not hold, from another
    stream of the same world): input_ids with the probe slots masked, positions, the slots'
    answers and a weight per slot (0 for padding)."""
    corpus = config.corpus
    world = World.draw(config.seed, corpus.num_symbols, corpus.num_fillers)
    out = {}
    inverse = np.argsort(world.cycle)
    for task, rows in probe_documents(config, world).items():
        mirrors = None
        if task == "direction":   # x masked in even documents, y in odd ones
            rows = [(words, [slots[i % 2]]) for i, (words, slots) in enumerate(rows)]
            # The answer of the mirrored document: g^-1 of x's right neighbour y taken as g(y),
            # and g(x) taken as g^-1(x). A direction-blind scheme that finds the neighbour
            # splits its predictions between the answer and this one.
            mirrors = [[f"d{world.cycle[int(words[slot + 1][1:])]}" if i % 2 == 0
                        else f"d{inverse[int(words[slot - 1][1:])]}"] for i, (words, (slot,)) in enumerate(rows)]
        out[task] = _masked_rows(rows, tokenizer, seq_len, mirrors)
    return out


def probe_documents(config: ml_collections.ConfigDict, world: World) -> dict[str, list[tuple[list[str], list[int]]]]:
    """Per task, `corpus.probe_docs` documents (words, probe slots) from a stream of their own,
    leaving out any the training text holds (e.g. the 16 `direction` documents without filler)."""
    corpus = config.corpus
    rng = np.random.default_rng([config.seed, 2])
    seen = set(training_texts(config, world))
    out = {}
    for task in TASKS:
        rows = out[task] = []
        while len(rows) < corpus.probe_docs:
            words, slots = document(rng, world, corpus, task)[1:]
            if " ".join(words) not in seen:
                rows.append((words, slots))
    return out


def _masked_rows(rows: list[tuple[list[str], list[int]]], tokenizer, seq_len: int,
                 mirrors: list[list[str]] | None = None) -> dict:
    num_slots = max(len(slots) for _, slots in rows)
    ids = np.full((len(rows), seq_len), tokenizer.pad_id, np.int32)
    masked_positions = np.zeros((len(rows), num_slots), np.int32)
    answers = np.zeros((len(rows), num_slots), np.int32)
    mirror_answers = np.full((len(rows), num_slots), -1, np.int32)
    weights = np.zeros((len(rows), num_slots), np.float32)
    for r, (words, slots) in enumerate(rows):
        if mirrors is not None:
            mirror_answers[r, :len(mirrors[r])] = tokenizer.encode_ids([" ".join(mirrors[r])])[0]
        tokens = tokenizer.encode_ids([" ".join(words)])[0]
        if len(tokens) != len(words):
            raise ValueError("the capability vocabulary does not hold every word of the corpus")
        if len(tokens) + 2 > seq_len:
            raise ConfigError(f"a probe document has {len(tokens)} words; raise pretrain.train.seq_len")
        row = [tokenizer.cls_id, *tokens, tokenizer.sep_id]
        ids[r, :len(row)] = row
        for s, slot in enumerate(slots):
            masked_positions[r, s] = slot + 1          # after [CLS]
            answers[r, s] = row[slot + 1]
            weights[r, s] = 1.0
            ids[r, slot + 1] = tokenizer.mask_id
    return {"input_ids": ids, "masked_positions": masked_positions, "answers": answers,
            "mirror_answers": mirror_answers, "weights": weights}


def probe_accuracy(model_config, params, batch: dict, chunk: int = 256, answers: str = "answers") -> float:
    """Fraction of probe slots whose argmax prediction is batch[answers] (the answer, or with
    "mirror_answers" the mirrored document's answer)."""
    correct = total = 0.0
    for lo in range(0, len(batch["input_ids"]), chunk):
        part = {k: v[lo:lo + chunk] for k, v in batch.items()}
        hits = _predict(model_config)(params, part["input_ids"], part["masked_positions"]) == part[answers]
        correct += float((hits * part["weights"]).sum())
        total += float(part["weights"].sum())
    return correct / total


_PREDICT_CACHE: dict = {}


def _predict(model_config):
    """Jitted argmax at the masked slots for one architecture (padding keys masked out)."""
    if model_config not in _PREDICT_CACHE:
        model = RoFormerForMaskedLM(model_config, rngs=nnx.Rngs(0))
        model.eval()
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def predict(params, input_ids, masked_positions):
            merged = nnx.merge(graphdef, params, rest)
            logits = merged(input_ids, attention_mask=input_ids != model_config.pad_token_id,
                            masked_positions=masked_positions)
            return jnp.argmax(logits, axis=-1)

        _PREDICT_CACHE[model_config] = predict
    return _PREDICT_CACHE[model_config]


# --------------------------------------------------------------------------- the check


def bag_of_words_bound(config: ml_collections.ConfigDict) -> dict[str, float]:
    """The accuracy a model blind to order (pairs) or to direction (direction) cannot exceed."""
    return {"pairs": 1.0 / config.corpus.pairs_per_doc, "direction": 0.5}


def scheme_config(config: ml_collections.ConfigDict, scheme: str, vocab: Path, text: Path
                  ) -> ml_collections.ConfigDict:
    """The pretraining config of one scheme: config.pretrain with the scheme's model keys and
    the synthetic corpus."""
    cfg = ml_collections.ConfigDict(config.pretrain.to_dict())
    cfg.model.update(arm_model_keys(scheme))
    if cfg.model.get("max_position_embeddings") is None:
        cfg.model.max_position_embeddings = cfg.train.seq_len
    cfg.train.seed = int(config.seed)
    cfg.data.source = "files"
    cfg.data.files = str(text)
    cfg.data.file_format = "text"
    cfg.data.vocab = str(vocab)
    return cfg


def expectations(config: ml_collections.ConfigDict, schemes: list[str]) -> dict[str, dict[str, bool]]:
    """Per scheme and task, whether the scheme is expected to pass: `none` passes nothing;
    schemes listed in config.expect_fail (`scheme:task`) are expected to fail that task."""
    fails = {tuple(item.split(":", 1)) for item in plan.split_list(config.expect_fail)}
    return {s: {t: s != "none" and (s, t) not in fails for t in TASKS} for s in schemes}


def validate(config: ml_collections.ConfigDict) -> list[str]:
    """The schemes to check; every problem with the config in one error."""
    problems = []
    if config.get("judge", "schemes") not in JUDGES:
        problems.append(f"config.judge={config.judge!r}: one of {', '.join(JUDGES)}")
    schemes = plan.split_list(config.schemes)
    if not schemes:
        problems.append("config.schemes is empty")
    for scheme in schemes:
        try:
            arm_model_keys(scheme)
        except ValueError as error:
            problems.append(str(error))
    for item in plan.split_list(config.expect_fail):
        scheme, _, task = item.partition(":")
        if task not in TASKS:
            problems.append(f"config.expect_fail item {item!r}: give scheme:task with task one of {list(TASKS)}")
    if not 0 < config.threshold <= 1:
        problems.append(f"config.threshold={config.threshold}: an accuracy in (0, 1]")
    corpus = config.corpus
    if corpus.pairs_per_doc < 2 or corpus.pairs_per_doc > corpus.num_symbols:
        problems.append(f"corpus.pairs_per_doc={corpus.pairs_per_doc}: between 2 and corpus.num_symbols")
    if corpus.direction_per_pairs < 0:
        problems.append(f"corpus.direction_per_pairs={corpus.direction_per_pairs}: a count >= 0")
    if corpus.num_symbols < 3:
        problems.append("corpus.num_symbols must be >= 3 (the direction cycle needs g(c) != g^-1(c))")
    longest = max(3 * corpus.pairs_per_doc - 1, 2 * corpus.max_filler + 3) + 2
    if longest > config.pretrain.train.seq_len:
        problems.append(f"pretrain.train.seq_len={config.pretrain.train.seq_len} is shorter than the longest "
                        f"document with [CLS]/[SEP] ({longest}); raise it or shorten the documents")
    if problems:
        raise ConfigError("capability config: " + "; ".join(problems))
    return schemes


def run_capability(config: ml_collections.ConfigDict, workdir: str | Path) -> dict:
    """Train every scheme on the synthetic corpus (or resume), probe every checkpoint, write
    capability.json and capability.md in `workdir`; returns the result."""
    schemes = validate(config)
    workdir = Path(workdir).resolve()
    with workdir_lock(workdir):
        workdir_kind.claim(workdir, workdir_kind.CAPABILITY)   # before anything is written
        workdir_kind.record(workdir, workdir_kind.CAPABILITY)
        vocab, text = write_corpus(config, workdir / "corpus")
        previous = _load_previous(workdir)
        rows = []
        for scheme in schemes:
            try:
                rows.append(_check_scheme(config, workdir, scheme, vocab, text, previous.get(scheme, {})))
            except Preempted as stop:   # its checkpoint is saved; the schemes after it wait too
                log.warning("%s; run the same command again to resume", stop)
                return {**_result(config, schemes, rows), "preempted": True}
            result = _result(config, schemes, rows)
            write_text_atomic(workdir / RESULT_JSON, json.dumps(result, indent=2) + "\n")
            write_text_atomic(workdir / RESULT_MD, to_markdown(result))
    return result


class Preempted(Exception):
    """A scheme's training stopped on SIGTERM (checkpoint saved): the check stops with it."""


def _load_previous(workdir: Path) -> dict:
    path = workdir / RESULT_JSON
    if not path.is_file():
        return {}
    return {row["scheme"]: row for row in json.loads(path.read_text()).get("schemes", [])}


def _check_scheme(config, workdir: Path, scheme: str, vocab: Path, text: Path, previous: dict) -> dict:
    """Train one scheme and probe each of its checkpoints (those already probed under the
    same config are reused)."""
    cfg = scheme_config(config, scheme, vocab, text)
    fp = plan.fingerprint(cfg, config.corpus, config.seed)
    run_dir = workdir / "runs" / scheme
    summary = {"diverged": False}
    try:
        summary = train.train_and_evaluate(cfg, run_dir)
    except FloatingPointError as error:   # a diverged run (NaN or a finite spike): report it, go on
        log.warning("%s: training stopped: %s", scheme, error)
        summary = {"diverged": True}
    if summary.get("preempted"):
        raise Preempted(f"{scheme}: training stopped by SIGTERM at step {summary.get('final_step')}")
    run = PretrainWorkdir(run_dir)
    tokenizer = run.tokenizer()
    batches = probe_batches(config, tokenizer, cfg.train.seq_len)
    done = {p["step"]: p for p in previous.get("curve", [])} if previous.get("fingerprint") == fp else {}
    curve = []
    for step in run.steps():
        if step not in done or MIRROR not in done[step]:
            model_config, params = run.params(step)
            done[step] = {"step": step, **{t: probe_accuracy(model_config, params, batches[t]) for t in TASKS},
                          MIRROR: probe_accuracy(model_config, params, batches["direction"],
                                                 answers="mirror_answers")}
        curve.append(done[step])
    return {"scheme": scheme, "fingerprint": fp, "diverged": bool(summary.get("diverged")), "curve": curve,
            "final_eval_loss": summary.get("eval_loss")}


def _result(config, schemes: list[str], rows: list[dict]) -> dict:
    bound = bag_of_words_bound(config)
    judge = config.get("judge", "schemes")
    expected = expectations(config, schemes)
    tokens_per_step = config.pretrain.train.batch_size * config.pretrain.train.seq_len
    for row in rows:
        final = row["curve"][-1] if row["curve"] else {}
        row["accuracy"] = {t: final.get(t) for t in TASKS}
        row["direction_mirror"] = final.get(MIRROR)
        row["steps_to_threshold"] = {t: next((p["step"] for p in row["curve"] if p[t] >= config.threshold), None)
                                     for t in TASKS}
        row["expected_pass"] = expected[row["scheme"]]
        row["passed"] = {t: row["accuracy"][t] is not None and row["accuracy"][t] >= config.threshold
                         for t in TASKS}
        if judge == "pipeline":
            row["as_expected"] = _pipeline_ran(row, bound, int(config.pretrain.train.steps),
                                               int(config.corpus.probe_docs))
        else:
            row["as_expected"] = all(row["passed"][t] == row["expected_pass"][t] for t in TASKS)
    return {"threshold": config.threshold, "bag_of_words_bound": bound, "tokens_per_step": tokens_per_step,
            "steps": int(config.pretrain.train.steps), "seed": int(config.seed), "judge": judge, "schemes": rows,
            "all_as_expected": all(r["as_expected"] for r in rows) and len(rows) == len(schemes)}


def _pipeline_ran(row: dict, bound: dict[str, float], steps: int, probe_docs: int) -> bool:
    """A pipeline check's verdict on one scheme: trained to `steps` without diverging, every
    probe an accuracy, and `none` within the bounds a model blind to order cannot pass. On
    `pairs` the bound holds document by document; on `direction` only on average (a
    prediction from the bag of words is right in half the documents on average, and by
    chance in more of a finite probe set), so there it gets three binomial standard errors."""
    curve = row["curve"]
    if row["diverged"] or not curve or curve[-1]["step"] != steps:
        return False
    if not all(0.0 <= p[t] <= 1.0 for p in curve for t in (*TASKS, MIRROR)):
        return False
    slack = {"pairs": 0.0, "direction": 3 * (0.25 / probe_docs) ** 0.5}
    return row["scheme"] != "none" or all(p[t] <= bound[t] + slack[t] for p in curve for t in TASKS)


def to_markdown(result: dict) -> str:
    bound = result["bag_of_words_bound"]
    lines = [f"Capability check: {result['steps']} steps x {result['tokens_per_step']:,} tokens, seed "
             f"{result['seed']}, threshold {result['threshold']:.2f}. A model blind to order cannot pass "
             f"{bound['pairs']:.3f} on `pairs`; one blind to direction cannot pass {bound['direction']:.2f} "
             "on `direction`. `mirrored`: how often `direction` predicts the answer of the mirrored "
             "document (a scheme that finds the partner but not its side splits between the two)."
             + (" A pipeline check: too few steps for any scheme to learn a rule, so only the run itself is "
                "judged." if result.get("judge") == "pipeline" else ""), "",
             "| scheme | pairs | first step >= threshold | direction | first step >= threshold | mirrored | "
             "expected | as expected |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["schemes"]:
        cells = [row["scheme"] + (" (diverged)" if row["diverged"] else "")]
        for task in TASKS:
            acc = row["accuracy"][task]
            cells.append("-" if acc is None else f"{acc:.3f}")
            cells.append(str(row["steps_to_threshold"][task] or "never"))
        cells.append("-" if row.get("direction_mirror") is None else f"{row['direction_mirror']:.3f}")
        if result.get("judge") == "pipeline":
            cells.append("trains, is probed" + (", within the bounds" if row["scheme"] == "none" else ""))
        else:
            cells.append(", ".join(f"{t} {'pass' if row['expected_pass'][t] else 'fail'}" for t in TASKS))
        cells.append("yes" if row["as_expected"] else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    result = run_capability(flags.FLAGS.config, flags.FLAGS.workdir)
    if result.get("preempted"):
        print("stopped (SIGTERM); run the same command again to resume", flush=True)
        return
    print(to_markdown(result), flush=True)
    print(done_line(flags.FLAGS.workdir), flush=True)
    if not result["all_as_expected"]:
        raise SystemExit(1)


def done_line(workdir: str) -> str:
    """The command's last line: where its outputs are."""
    return (f"done: result in {workdir}/{RESULT_MD} and {workdir}/{RESULT_JSON}, each scheme's run in "
            f"{workdir}/runs/<scheme>, the corpus in {workdir}/corpus")


if __name__ == "__main__":
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "capability config file (configs/capability.py[:smoke])")
    flags.DEFINE_string("workdir", None, "directory for the corpus, the runs and the result")
    flags.mark_flags_as_required(["config", "workdir"])
    cli.run(main, doc=__doc__, help_config=cli.CONFIG_DIR / "capability.py")
