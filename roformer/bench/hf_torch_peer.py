"""transformers' PyTorch RoFormerForMaskedLM train step in a process of its own, served to
`python -m roformer.bench hf` with hf_flax_peer.py's protocol.

Run as `python -m roformer.bench.hf_torch_peer`: the step runs as it ships, in a Python
process that has not changed anything for our step (roformer.host_memory's malloc settings
are made only by our command lines). The request carries our ModelConfig (as a dict), the
sequence length and batch size, the torch.compile backend (none: eager), the number of
torch threads (0: torch's default) and whether the MLM head runs at the masked positions only; the model, batch and optimizer are built by
roformer.bench.hf exactly as for the in-process peers.
"""
import sys

from roformer.bench.hf_flax_peer import serve


def build_torch_step(request):
    # imported here: serve() turns an ImportError into its error reply, and what the libraries
    # print on import goes to stderr once serve() redirected it
    import torch
    import transformers

    from roformer.bench.hf import torch_train_step
    from roformer.bench.workload import synthetic_batch
    from roformer.model import ModelConfig

    if request["torch_threads"] > 0:
        torch.set_num_threads(request["torch_threads"])
    config = ModelConfig.from_dict(request["config"])
    batch = synthetic_batch(config, request["batch"], request["seq_len"])
    device = request.get("device", "cpu")
    step = torch_train_step(config, batch, compile_backend=request["compile_backend"], device=device,
                            masked_head=request.get("masked_head", False))
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads(), "torch_device": device}
    if device == "cuda":
        versions["torch_gpu"] = torch.cuda.get_device_name()
    return step, versions


if __name__ == "__main__":
    sys.exit(serve(build_torch_step))
