"""The config fingerprints of the ablation's stages, pinned.

A stage of an existing ablation workdir is skipped only when its fingerprint is the one
recorded in ablation_state.json. A changed value below means every existing workdir of
that variant reruns those stages (hours of training for :reference, :onset and :long): change
the fingerprint, the configs or what is fingerprinted only on purpose, and then update
these values.
"""
from pathlib import Path

import pytest

from roformer.ablation import collect, plan

# Fixed paths, so the fingerprints (which include data paths and the extension's
# init_from) do not depend on where the repository or the shared data live.
SHARED_DATA = "/shared/data"
WORKDIR = Path("/ablation")

# Every stage of seed 0 (the other seeds differ only in train.seed) and the report's caches.
PINNED = {
    "smoke": {
        "extension/base/seed0 extension": "3c5789f552da3138",
        "extension/base/seed0 extension_eval": "0a6fc2f72d0cba90",
        "extension/linear/seed0 extension": "dab2d50a63b69b5e",
        "extension/linear/seed0 extension_eval": "f44020d1a44ac847",
        "extension/none/seed0 extension": "f06720f5ac690874",
        "extension/none/seed0 extension_eval": "2494d6c07f26f2e0",
        "extension/ntk/seed0 extension": "def1b8071d96800a",
        "extension/ntk/seed0 extension_eval": "1fea7a0f7d021da1",
        "extension/yarn/seed0 extension": "ebc9b5c03ff92dfc",
        "extension/yarn/seed0 extension_eval": "0fc5a53704dc8449",
        "learned/seed0 extrapolation": "884993fe7afea7f2",
        "learned/seed0 glue": "15ca6dc36ee9ad9b",
        "learned/seed0 pretrain": "85074130782f3f97",
        "position_signal": "1814e943a5a8d126",
        "rope/seed0 extrapolation": "644116a83cce8d82",
        "rope/seed0 glue": "1d87c54fa6337f12",
        "rope/seed0 pretrain": "f30a15548ce90e8f",
        "unigram_loss": "7baa2e7868d6fb1a",
    },
    "reference": {
        "alibi/seed0 extrapolation": "3c4b6ace64066459",
        "alibi/seed0 glue": "3c9efbbba88de4bb",
        "alibi/seed0 pretrain": "4d24ef5c9b6bc005",
        "extension/base/seed0 extension": "49b84bb3241bdbdc",
        "extension/base/seed0 extension_eval": "17b1b88ad84a1c09",
        "extension/linear/seed0 extension": "8dcf900811cca6f0",
        "extension/linear/seed0 extension_eval": "90bcc267be2154e8",
        "extension/none/seed0 extension": "bcac47de513650af",
        "extension/none/seed0 extension_eval": "7fb6313c30ba86bd",
        "extension/ntk/seed0 extension": "9eb23486931dce9b",
        "extension/ntk/seed0 extension_eval": "c332103e22142d43",
        "extension/yarn/seed0 extension": "db6db945713e6cf4",
        "extension/yarn/seed0 extension_eval": "f3137cb4e861d84d",
        "learned/seed0 extrapolation": "be7c4a5d86e2d8ba",
        "learned/seed0 glue": "ff034a91d6205927",
        "learned/seed0 pretrain": "cfd84a185955742b",
        "none/seed0 extrapolation": "78cdcbd2d0da7fd9",
        "none/seed0 glue": "97d489f0a4a77783",
        "none/seed0 pretrain": "09df95e55acb9a46",
        "position_signal": "425382079ff54e00",
        "rope/seed0 extrapolation": "d761c2961df2748f",
        "rope/seed0 glue": "bd2b49d1b2cbf211",
        "rope/seed0 pretrain": "c55b1fbb3c709430",
        "shaw/seed0 extrapolation": "f56a71d0bd4eece9",
        "shaw/seed0 glue": "f81acebfab55b0ad",
        "shaw/seed0 pretrain": "f300a97514dbe1f2",
        "sinusoidal/seed0 extrapolation": "2ad48fbdfb78930d",
        "sinusoidal/seed0 glue": "698538a3d9e0ad05",
        "sinusoidal/seed0 pretrain": "fdf247082adfa16a",
        "t5/seed0 extrapolation": "3aa420ff5c9240de",
        "t5/seed0 glue": "2926bcf035738465",
        "t5/seed0 pretrain": "1ad2ef48974d93d6",
        "unigram_loss": "c7bc3275850ac174",
    },
    "onset": {
        "alibi/seed0 extrapolation": "70aa5f06e7067f79",
        "alibi/seed0 glue": "725b5736fddac05b",
        "alibi/seed0 pretrain": "99da24b612d2feea",
        "extension/base/seed0 extension": "0349221142e19eca",
        "extension/base/seed0 extension_eval": "72736422448db89a",
        "extension/linear/seed0 extension": "a347dc1a4d853d26",
        "extension/linear/seed0 extension_eval": "c1d275c62f849360",
        "extension/none/seed0 extension": "33d54978b206b362",
        "extension/none/seed0 extension_eval": "bff00571c802c5b9",
        "extension/ntk/seed0 extension": "9236b0d308b8e271",
        "extension/ntk/seed0 extension_eval": "7f1bb13047ea65f8",
        "extension/yarn/seed0 extension": "95be93fb91f7105d",
        "extension/yarn/seed0 extension_eval": "b3a39ee8937d031b",
        "learned/seed0 extrapolation": "ac52fbf861540be2",
        "learned/seed0 glue": "1802d5a6ebfe14c2",
        "learned/seed0 pretrain": "08e2bb97db9e0d1c",
        "none/seed0 extrapolation": "43d87bc7429c602e",
        "none/seed0 glue": "64fe366e02ae1367",
        "none/seed0 pretrain": "68e63b46c431d5bf",
        "position_signal": "425382079ff54e00",
        "rope/seed0 extrapolation": "a2dbd9cc93638d8d",
        "rope/seed0 glue": "b11e7e334b254607",
        "rope/seed0 pretrain": "f043dcf8c52967ab",
        "shaw/seed0 extrapolation": "0696fa89eb92e382",
        "shaw/seed0 glue": "03d607f5f7d82d79",
        "shaw/seed0 pretrain": "b58970b960018332",
        "sinusoidal/seed0 extrapolation": "10690f96e76be027",
        "sinusoidal/seed0 glue": "d85c0fb60a5cc22f",
        "sinusoidal/seed0 pretrain": "f6e6e58b6b214bf8",
        "t5/seed0 extrapolation": "28803214569504d3",
        "t5/seed0 glue": "42e371186b548f9f",
        "t5/seed0 pretrain": "61c911692275977f",
        "unigram_loss": "c7bc3275850ac174",
    },
    "long": {
        "extension/base/seed0 extension": "2e718dde943ad349",
        "extension/base/seed0 extension_eval": "63c571f72c167126",
        "extension/linear/seed0 extension": "4be41e283c8cdaa8",
        "extension/linear/seed0 extension_eval": "4cf900278a142b68",
        "extension/none/seed0 extension": "3414cfd4e19bb3d4",
        "extension/none/seed0 extension_eval": "91a77807938ac22d",
        "extension/ntk/seed0 extension": "73f5d79ce8e0cb63",
        "extension/ntk/seed0 extension_eval": "938a07169a71dd87",
        "extension/yarn/seed0 extension": "019646ac38e22d3b",
        "extension/yarn/seed0 extension_eval": "eb601f19f0126b35",
        "learned/seed0 extrapolation": "be61330be09dd34e",
        "learned/seed0 pretrain": "d857e8cc7a597e04",
        "position_signal": "a9ca32580ec81c8e",
        "rope/seed0 extrapolation": "f4fed38606429ffa",
        "rope/seed0 pretrain": "07caf176c1a5fcec",
        "unigram_loss": "c7bc3275850ac174",
    },
}


def stage_fingerprints(variant: str) -> dict[str, str]:
    config = plan.load_config_file("ablation", variant)
    config.extension.enabled = True   # pinned for every variant, also those that leave it off
    the_plan = plan.build_plan(config, WORKDIR, str(WORKDIR / "tokenizer.json"))
    out = {f"{run.name} {stage.name}": stage.fingerprint for run in the_plan.runs if run.seed == 0
           for stage in run.stages}
    out["position_signal"] = collect.position_signal_fingerprint(the_plan)
    out["unigram_loss"] = plan.fingerprint(config.pretrain.data)
    return out


@pytest.mark.parametrize("variant", sorted(PINNED))
def test_stage_fingerprints_are_unchanged(variant, monkeypatch):
    monkeypatch.setenv("ROFORMER_SHARED_DATA", SHARED_DATA)
    assert stage_fingerprints(variant) == PINNED[variant], (
        f"configs/ablation.py:{variant}: a stage fingerprint changed, so existing ablation workdirs "
        "rerun those stages; change a fingerprint only on purpose, then update PINNED")


def test_glue_settings_that_only_show_cache_or_pick_a_kernel_leave_the_fingerprint():
    from roformer.configs import glue as glue_config

    glue = glue_config.get_config()
    before = plan.fingerprint("pretrain", glue)
    glue.progress_bar = not glue.progress_bar
    glue.compilation_cache_dir = "/elsewhere"
    glue.save_models = "none"
    glue.train_padding = "call"
    glue.model.attention_impl = "cudnn"
    glue.grad_accum = 4
    glue.per_task.rte.grad_accum = 2
    glue.checkpoint_every = 0
    assert plan.fingerprint("pretrain", glue) == before
    glue.learning_rate *= 2
    assert plan.fingerprint("pretrain", glue) != before
