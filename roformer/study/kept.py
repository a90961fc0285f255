"""The members a study keeps for the downstream arm (roformer.study.downstream), on disk.

A scheme's group trains every seed x rate stacked on a leading axis; the report scores, per
budget, the rate the tuning seeds chose on the validation split, at the scored seeds. Those
members at the last budget (the trunk's final state) are what a downstream comparison
fine-tunes, so after each of a scheme's groups the study saves them, one folder each:

    kept/<scheme>/seed<k>/   model_config.json + params/   roformer.convert's format (orbax)
                             tokenizer.json + vocab.txt    the corpus's tokenizer (the pack's)
                             member.json                   scheme, seed, rate, budget, fingerprint

so `python -m roformer.glue --config.init=kept/rope/seed2` fine-tunes one as it would any
converted model. member.json is written last: a folder without it is not a kept member (a
save cut short). A group beyond the grid's edge (study.extend_edges) may move the choice to
one of its rates; its members then replace the seed's folder. Each folder is a member of the
record whose members it counts (`record_members`): when archives of several runs hold one
seed, the one chosen on the larger record is taken, as roformer.study.records takes records.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from roformer.errors import ConfigError
from roformer.files import write_bytes_atomic, write_json_atomic
from roformer.study.records import KEPT_DIR

log = logging.getLogger("roformer.study")

MEMBER_FILE = "member.json"


def member_dir(root: Path, scheme: str, seed: int) -> Path:
    return Path(root) / KEPT_DIR / scheme / f"seed{seed}"


def chosen_members(record: dict, tuning_seeds: Iterable[int], scored_seeds: Iterable[int]) -> list[dict]:
    """The record's members the report scores at its last budget: at the rate the tuning seeds
    chose there (roformer.study.report.choose_rate), of the scored seeds, by seed."""
    from roformer.study.report import choose_rate   # the report's rule, read where it is kept

    last = record["budgets"][-1]
    rates = sorted({m["rate"] for m in record["members"]})
    rate = rates[choose_rate(record, last, set(tuning_seeds))]
    scored = set(scored_seeds)
    return sorted((m for m in record["members"] if m["rate"] == rate and m["seed"] in scored),
                  key=lambda m: m["seed"])


def member_params(params, position: int) -> dict:
    """One member's parameters (a pure dict, on the host) from a group's stacked ones."""
    return jax.tree.map(lambda leaf: np.asarray(leaf[position]), params)


def save_member(directory: Path, model_cfg, params: dict, tokenizer_json: str, meta: dict) -> Path:
    """One member as a converted model with its tokenizer and member.json (written last)."""
    from tokenizers import Tokenizer

    from roformer.convert import save_converted
    from roformer.data.tokenizer import WordPieceTokenizer
    from roformer.model import RoFormerForMaskedLM

    directory = Path(directory)
    (directory / MEMBER_FILE).unlink(missing_ok=True)   # until the new parameters are whole
    model = nnx.eval_shape(lambda: RoFormerForMaskedLM(model_cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    save_converted(model, directory)
    WordPieceTokenizer(Tokenizer.from_str(tokenizer_json), where="the study's tokenizer").save(directory)
    write_json_atomic(directory / MEMBER_FILE, meta, indent=2)
    return directory


class Keeper:
    """Saves a scheme's chosen-rate scored members after each of its groups trains
    (downstream.keep_members): `keep(scheme, record, params, group)` with the scheme's record
    as saved (merged with the groups before) and the group's stacked final parameters."""

    def __init__(self, workdir: Path, plan, data):
        self.workdir, self.plan, self.data = Path(workdir), plan, data

    @classmethod
    def start(cls, workdir: Path, plan, data) -> Keeper | None:
        """A keeper when the config keeps members (None otherwise); ConfigError when the splits
        came from a pack without the tokenizer, before anything trains."""
        downstream = plan.config.get("downstream")
        if downstream is None or not downstream.get("keep_members", False):
            return None
        if not data.tokenizer_json:
            raise ConfigError(f"study.data_pack={plan.study.data_pack!r} was made before packs held the tokenizer, "
                              "which the kept members need: make it again (`python -m roformer.study pack`), or "
                              "--config.downstream.keep_members=false")
        return cls(workdir, plan, data)

    def keep(self, scheme: str, record: dict, params, group: Sequence) -> list[Path]:
        """Save the members of `group` (its stacked `params`, in group order) that `record`'s
        choice scores; returns their folders."""
        if not record["members"]:
            return []
        prereg = self.plan.preregistration
        positions = {member.index: i for i, member in enumerate(group)}
        chosen = [m for m in chosen_members(record, prereg.tuning_seeds, prereg.scored_seeds)
                  if m["index"] in positions]
        model_cfg = self.plan.model_config(scheme, self.data.vocab_size, self.data.pad_id)
        last = record["budgets"][-1]
        saved = []
        for member in chosen:
            meta = {"scheme": scheme, "seed": member["seed"], "rate": member["rate"], "index": member["index"],
                    "steps": last["steps"], "tokens": last["tokens"], "fingerprint": record.get("fingerprint"),
                    "record_members": len(record["members"]), "position": model_cfg.position}
            saved.append(save_member(member_dir(self.workdir, scheme, member["seed"]), model_cfg,
                                     member_params(params, positions[member["index"]]), self.data.tokenizer_json,
                                     meta))
        if saved:
            log.info("%s: kept %d member(s) at rate %g for the downstream arm in %s", scheme, len(saved),
                     chosen[0]["rate"], self.workdir / KEPT_DIR / scheme)
        return saved


# --------------------------------------------------------------------------- reading them back


@dataclasses.dataclass(frozen=True)
class KeptMember:
    scheme: str
    seed: int
    path: Path
    meta: dict


def read_members(root: Path) -> list[KeptMember]:
    """The whole kept members under root/kept (a folder with member.json)."""
    found = []
    for meta_path in sorted(Path(root).glob(f"{KEPT_DIR}/*/seed*/{MEMBER_FILE}")):
        try:
            meta = json.loads(meta_path.read_text())
            found.append(KeptMember(str(meta["scheme"]), int(meta["seed"]), meta_path.parent, meta))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s cannot be read: that member is left out", meta_path)
    return found


def _unpack(archive: Path, into: Path) -> None:
    """The kept members of an archive (kept/...) into `into`, nothing else."""
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name.removeprefix("./")
                parts = Path(name).parts
                if member.isfile() and parts and parts[0] == KEPT_DIR and ".." not in parts:
                    (into / name).parent.mkdir(parents=True, exist_ok=True)
                    write_bytes_atomic(into / name, tar.extractfile(member).read())
    except (tarfile.TarError, OSError) as error:
        raise ConfigError(f"cannot read archive {archive}: {error}") from error


def gather(sources: Sequence[str | Path], into: Path) -> dict[tuple[str, int], KeptMember]:
    """Per (scheme, seed), the kept member to fine-tune, from `sources`: study workdirs (their
    kept/), archives holding kept/ or folders of them; archives
    are unpacked into `into`/<n> (records archives hold them too: scripts/gpu_comparison.sh's
    records.tar.gz, or `split`'s per-scheme archives). Where several hold a seed, the one chosen on the record with
    the most members is taken (the later source on a tie), and the others are said in a line."""
    roots: list[Path] = []
    for source in map(Path, sources):
        if (source / KEPT_DIR).is_dir():
            roots.append(source)
            continue
        archives = sorted(source.glob("*.tar.gz")) if source.is_dir() else [source] if source.is_file() else []
        if not archives:
            raise ConfigError(f"{source} is neither a study workdir with kept members ({KEPT_DIR}/) nor a kept-members "
                              "archive or a folder of them (*.tar.gz)")
        for archive in archives:
            root = Path(into) / str(len(roots))
            shutil.rmtree(root, ignore_errors=True)
            _unpack(archive, root)
            roots.append(root)
    chosen: dict[tuple[str, int], tuple[tuple[int, int], KeptMember]] = {}
    for order, root in enumerate(roots):
        for member in read_members(root):
            key, rank = (member.scheme, member.seed), (int(member.meta.get("record_members", 0)), order)
            if key in chosen:
                log.info("%s seed %d: kept in %s and %s; taking the one chosen on the larger record", *key,
                         chosen[key][1].path, member.path)
            if key not in chosen or rank >= chosen[key][0]:
                chosen[key] = (rank, member)
    if not chosen:
        raise ConfigError(f"no kept members in {', '.join(map(str, sources))}: a study keeps them with "
                          "downstream.keep_members (on in configs/study.py)")
    taken = {key: member for key, (_, member) in sorted(chosen.items())}
    for scheme in sorted({scheme for scheme, _ in taken}):
        prints = {str(m.meta.get("fingerprint")) for (s, _), m in taken.items() if s == scheme}
        if len(prints) > 1:
            log.warning("%s: its kept members come from records of different settings (fingerprints %s): "
                        "their pretraining differs", scheme, ", ".join(sorted(prints)))
    return taken
