"""What the study's tests share: a variant of configs/study.py with some study settings changed."""
from roformer import config_files as plan
from roformer.cli import load_config


def config(variant="gpu_smoke", **study_keys):
    c = load_config(f"{plan.CONFIG_DIR / 'study.py'}:{variant}")
    for key, value in study_keys.items():
        c.study[key] = value
    return c
