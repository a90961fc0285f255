"""Base MLM pretraining config; the per-scheme files change a few keys.

`get_config("size=base,source=files")` takes comma-separated overrides for the
model size preset and the data source; any key can also be set on the command
line, e.g. `--config.train.steps=1000 --config.model.size=mini`.
"""
import ml_collections
from ml_collections import config_dict


def parse_arg(arg: str | None) -> dict[str, str]:
    """'size=base,source=files' -> {'size': 'base', 'source': 'files'}."""
    if not arg:
        return {}
    pairs = [item.split("=", 1) for item in arg.split(",") if item]
    bad = [p[0] for p in pairs if len(p) != 2]
    if bad:
        raise ValueError(f"config argument items must be key=value, got {bad} in {arg!r}")
    known = {"size", "source"}
    unknown = sorted({k for k, _ in pairs} - known)
    if unknown:
        raise ValueError(f"unknown config argument(s) {unknown}; known: {sorted(known)}")
    return dict(pairs)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    config = ml_collections.ConfigDict()

    # Model: a size preset plus ModelConfig fields. The architecture sizes are
    # placeholders: None = take the preset's value. vocab_size comes from the data.
    model = config.model = ml_collections.ConfigDict()
    model.size = args.get("size", "base")
    for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings"):
        model[name] = config_dict.placeholder(int)
    model.embedding_size = config_dict.placeholder(int)
    model.rotary_dim = config_dict.placeholder(int)
    model.type_vocab_size = 2
    model.hidden_dropout = 0.1
    model.attention_dropout = 0.1
    model.layer_norm_eps = 1e-12
    model.hidden_act = "gelu"
    model.pre_layer_norm = False
    model.initializer_range = 0.02
    model.position = "rope"
    model.attention = "softmax"
    model.attention_impl = "auto"  # cudnn: fused GPU kernel (bf16, attention_dropout=0)
    model.rope_base = 10000.0
    model.rope_layout = "interleaved"
    model.rotary_value = False
    model.rope_scaling = "none"
    model.rope_scaling_factor = 1.0
    model.rope_original_max_len = 512
    model.shaw_max_distance = 16
    model.t5_num_buckets = 32
    model.t5_max_distance = 128

    data = config.data = ml_collections.ConfigDict()
    data.source = args.get("source", "embedded")
    data.files = ""
    data.file_format = "auto"
    data.hf_path = ""
    data.hf_name = ""
    data.hf_split = "train"
    data.hf_text_column = "text"
    data.hf_streaming = False
    data.hf_data_files = ""
    data.tfds_name = ""
    data.tfds_split = "train"
    data.tfds_data_dir = ""
    data.tfds_text_key = "text"
    data.vocab = ""
    data.vocab_size = 8000
    data.lowercase = True
    data.cache_dir = ""
    data.packing = "packed"
    data.mask_rate = 0.15
    data.max_predictions_per_seq = 0
    data.whole_word_masking = False
    data.heldout_fraction = 0.02
    data.num_workers = 0

    train = config.train = ml_collections.ConfigDict()
    train.steps = 100_000
    train.batch_size = 256          # global, over all processes
    train.seq_len = 512
    train.learning_rate = 1e-4
    train.warmup_steps = 10_000
    train.decay = "linear"          # linear | cosine
    train.decay_steps = 0           # schedule length; 0 -> train.steps (set it to extend a run
                                    # past its schedule without changing the learning rates so far)
    train.weight_decay = 0.01
    train.b1 = 0.9
    train.b2 = 0.999
    train.eps = 1e-6
    train.clip_norm = 1.0
    train.grad_accum = 1            # micro-batches per optimizer step
    train.seed = 0
    train.dropout_rng_impl = "threefry2x32"   # dropout keys: threefry2x32 | rbg | unsafe_rbg
    train.phases = ""               # 'steps:seq_len:batch_size,...' phases run in order (overrides
                                    # steps/seq_len/batch_size), e.g. '900:128:32,100:512:8'
    train.init_from = ""            # warm start (parameters only, step 0): a pretraining workdir, an
                                    # HF RoFormer directory or a roformer.convert output
    train.init_step = -1            # its checkpoint step (pretraining workdir); -1 = newest
    train.init_grow_positions = ""  # "copy": repeat a shorter learned position table's rows
    train.log_every = 100
    train.eval_every = 2_000
    train.eval_batches = 20
    train.eval_shuffled = True      # also evaluate with each document's tokens shuffled: the loss
                                    # increase (eval_order_gap) says how much the model uses word order
    train.checkpoint_every = 2_000
    train.keep_checkpoints = 3
    train.async_checkpoints = True
    train.dtype = "float32"         # compute dtype: float32 | bfloat16 (params stay float32)
    train.peak_flops_per_device = 0.0   # 0 -> table (TPU/GPU) or a measured matmul peak (CPU)
    train.progress_bar = True
    train.debug_nan_step = -1       # testing aid: poison the loss at this step

    # Device mesh: one -1 axis takes the remaining devices. num_devices > 0 uses
    # only the first N devices (single process).
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "num_devices": 0})

    # Multi-host: empty/-1 -> jax.distributed.initialize() auto-detects on TPU pods
    # and SLURM; set all three for a manual cluster. `enabled` forces initialisation.
    dist = config.distributed = ml_collections.ConfigDict()
    dist.enabled = False
    dist.coordinator_address = ""
    dist.num_processes = -1
    dist.process_id = -1
    dist.local_device_ids = ""
    return config
