"""mcore-rl: GRPO post-training end to end."""

from mcore_rl._version import __version__
from mcore_rl.advantages import compute_advantages
from mcore_rl.config import (
    DataConfig,
    EvalConfig,
    GRPOConfig,
    ModelConfig,
    PackingConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from mcore_rl.errors import (
    PackingError,
    RLCheckpointError,
    RLConfigError,
    RLDataError,
    RLError,
    RLInputError,
    RLStateError,
    TaskError,
    TokenizerError,
)
from mcore_rl.hf import ChatTokenizer, copy_tokenizer_files
from mcore_rl.loss import LossConfig, grpo_loss, kl_k3
from mcore_rl.moe_config import MoEModelConfig
from mcore_rl.packing import PackingContext, PackingInfo, distribute_bins, pack_sequences
from mcore_rl.presets import PRESETS, preset
from mcore_rl.prompt_data import PromptDataset, load_prompt_dataset
from mcore_rl.reference import ReferenceWeights
from mcore_rl.rewards import REWARDS, RewardScorer, format_reward, math_reward
from mcore_rl.rollout import Rollout, evaluate_greedy, generate_rollouts
from mcore_rl.router_loss import RouterLoss
from mcore_rl.run import RunResult, run_grpo
from mcore_rl.tasks import (
    ArithmeticTask,
    CountdownTask,
    DatasetTask,
    FunctionTask,
    Problem,
    ReverseTask,
    SortTask,
    Task,
    available_tasks,
    get_task,
    register_task,
    sample_problems,
)
from mcore_rl.tokenizer import CharTokenizer
from mcore_rl.worker import GRPOWorker, Minibatch

__all__ = [
    "__version__",
    "RLError",
    "RLConfigError",
    "PackingError",
    "TaskError",
    "TokenizerError",
    "RLInputError",
    "RLStateError",
    "RLCheckpointError",
    "RLDataError",
    "GRPOConfig",
    "RunConfig",
    "ModelConfig",
    "MoEModelConfig",
    "TaskConfig",
    "DataConfig",
    "RewardConfig",
    "RolloutConfig",
    "PackingConfig",
    "EvalConfig",
    "ParallelConfig",
    "PRESETS",
    "preset",
    "run_grpo",
    "RunResult",
    "GRPOWorker",
    "Minibatch",
    "ChatTokenizer",
    "copy_tokenizer_files",
    "PromptDataset",
    "load_prompt_dataset",
    "REWARDS",
    "RewardScorer",
    "math_reward",
    "format_reward",
    "evaluate_greedy",
    "ReferenceWeights",
    "Rollout",
    "generate_rollouts",
    "compute_advantages",
    "LossConfig",
    "grpo_loss",
    "kl_k3",
    "RouterLoss",
    "pack_sequences",
    "PackingInfo",
    "PackingContext",
    "distribute_bins",
    "CharTokenizer",
    "Task",
    "Problem",
    "FunctionTask",
    "ArithmeticTask",
    "CountdownTask",
    "DatasetTask",
    "SortTask",
    "ReverseTask",
    "register_task",
    "get_task",
    "available_tasks",
    "sample_problems",
]
