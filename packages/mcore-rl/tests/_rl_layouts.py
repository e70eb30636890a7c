"""Shared by the GRPO layout test files (dense model-parallel and MoE expert-parallel): the tiny
run config, the steps every layout runs, and what is compared across layouts."""

from mcore_models.init import global_slice
from mcore_rl.distributed import init_worker_state
from mcore_rl.worker import GRPOWorker

TINY = {
    "model": {
        "hidden_size": 32,
        "num_layers": 4,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "ffn_hidden_size": 64,
        # 17 characters padded to 18: ids the tokenizer lacks exist on every layout.
        "vocab_size": 18,
    },
    "rollout": {"num_prompts": 4, "group_size": 3, "max_new_tokens": 3},
    "loss": {"kl_beta": 0.05, "entropy_coef": 0.1},
    "optimizer": {"lr": 1e-2},
    "run": {"progress": False, "device": "cpu", "target_reward": None, "plot": False},
}
STEPS = 3


def rollout_key(metrics):
    """The metrics that must agree across layouts.

    Timings, memory and bytes moved differ by layout; so does the number of rows per rank
    (interleaved pipelines pad it to a multiple of pp with empty rows).
    """
    skip = ("time/", "memory/", "reshard/", "packing/bins_per_rank")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def run_steps(worker):
    """Runs ``STEPS`` GRPO steps as the loop does (generate, train, push the weights).

    Returns:
        Per step: the rollouts' (prompt, completion) ids, the training metrics and the push.
    """
    steps = []
    for step in range(STEPS):
        rollouts = worker.generate(step)
        tokens = [(r.prompt_ids, r.completion_ids) for r in rollouts]
        metrics = worker.train_on_rollouts(rollouts)
        with worker.generation_mode():
            pushed = worker.inference.push()
        steps.append((tokens, metrics, pushed))
    return steps


def parameter_blocks(chunks):
    """Every parameter of ``chunks`` as its block of the whole model.

    Returns:
        ``{name: (box, tensor, global shape)}``.
    """
    blocks = {}
    for chunk in chunks:
        for param in chunk.parameters():
            where = global_slice(param)
            box = where.box(tuple(param.shape))
            blocks[where.name] = (box, param.detach().clone(), tuple(where.global_shape))
    return blocks


def train_layout(config):
    """Builds the worker of ``config``, runs :func:`run_steps` and reads what the layout holds.

    Returns:
        The worker (still open) and its parallel state, and ``{"steps", "blocks" (see
        :func:`parameter_blocks`), "shared" (whether generation runs the training chunks),
        "local" (bytes of this rank's generation parameters)}``.
    """
    state = init_worker_state(config)
    worker = GRPOWorker(config, state)
    steps = run_steps(worker)
    worker.optimizer.start_param_sync(force_sync=True)
    with worker.optimizer.param_sync_hooks_disabled():
        blocks = parameter_blocks(worker.chunks)
    inference = worker.inference
    local = sum(p.numel() * p.element_size() for p in inference.model.parameters())
    report = {"steps": steps, "blocks": blocks, "shared": inference.shared, "local": local}
    return worker, state, report
