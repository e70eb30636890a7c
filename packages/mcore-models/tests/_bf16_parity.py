"""Shared by the GPU test files: how far bf16 logits are from transformers' fp32 logits, for
mcore's forward and for transformers' own bf16 forward."""

import copy

import torch

from mcore_models import GPTModel


def bf16_errors(hf_model, directory, ids, backend):
    """The largest absolute logit error against transformers in fp32 on the GPU.

    Args:
        hf_model: The transformers model (fp32, on the CPU; copied, not moved).
        directory: Its saved checkpoint.
        ids: Token ids on the GPU.
        backend: mcore's attention backend.

    Returns:
        mcore's bf16 error and transformers' bf16 error.
    """
    with torch.no_grad():
        reference = copy.deepcopy(hf_model).cuda()(ids).logits.float()
        hf_bf16 = copy.deepcopy(hf_model).to("cuda", torch.bfloat16)(ids).logits.float()
        model = GPTModel.from_hf(
            directory, dtype="bfloat16", device="cuda", attention_backend=backend
        ).eval()
        ours = model(ids)
    return (ours - reference).abs().max().item(), (hf_bf16 - reference).abs().max().item()
