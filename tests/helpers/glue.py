"""What the GLUE tests share: a tiny fine-tuning run's config."""
from roformer.configs import glue as glue_config


def tiny_config(shared_data, vocab, tasks="mrpc,stsb"):
    """configs/glue.py on the tiny model: `tasks` (a comma list) on 24 training and 16
    evaluation examples of the shared GLUE data, one seed, one epoch of batch 8 x 32."""
    config = glue_config.get_config()
    config.task = tasks
    config.vocab = vocab
    config.data_dir = str(shared_data / "glue")
    config.model.size = "tiny"
    config.seeds = 1
    config.max_train_examples = 24
    config.max_eval_examples = 16
    config.batch_size = 8
    config.eval_batch_size = 16
    config.max_seq_len = 32
    config.num_epochs = 1.0
    config.progress_bar = False
    return config
