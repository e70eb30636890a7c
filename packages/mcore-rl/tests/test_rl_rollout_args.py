"""generate_rollouts rejects bad arguments with a typed error before building an engine."""

import pytest

from mcore_models import GPTConfig, GPTModel
from mcore_rl.errors import RLInputError
from mcore_rl.rollout import generate_rollouts
from mcore_rl.tasks import get_task, sample_problems
from mcore_rl.tokenizer import CharTokenizer


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("group_size", 0, "group_size=0 must be >= 1"),
        ("max_new_tokens", 0, "max_new_tokens=0 must be >= 1"),
        ("parallel_generation_tasks", 0, "parallel_generation_tasks=0 must be >= 1"),
        ("temperature", 0.0, "temperature=0.0 must be > 0"),
    ],
)
def test_generate_rollouts_rejects_bad_arguments(name, value, message):
    task = get_task("arithmetic")
    tokenizer = CharTokenizer(task.alphabet)
    config = GPTConfig.from_name(
        "tiny", vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, seed=0
    )
    arguments = dict(
        task=task,
        tokenizer=tokenizer,
        group_size=2,
        max_new_tokens=2,
        temperature=1.0,
        seed=0,
        parallel_generation_tasks=4,
        use_cuda_graphs=False,
    )
    arguments[name] = value
    with pytest.raises(RLInputError, match=message):
        generate_rollouts(GPTModel(config), sample_problems(task, 2, seed=0), **arguments)
