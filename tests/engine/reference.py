"""A reference forward for the engine's tests: every position's logits of one sequence, computed
by the model alone (no scheduler, sampler or cache reuse), in one pass or in chunks."""

import torch

from engine.config import EngineConfig
from engine.model import AttnMetadata
from engine.model_runner import ModelRunner, load_model_config


def all_logits(model: str, ids: list[int], chunk: int | None = None, hf_overrides=None,
               device: str = "cpu") -> torch.Tensor:
    """``[len(ids), vocab]`` fp32 logits of ``model`` (a checkpoint folder or ``random:`` preset) over
    ``ids``, on the host. A ``random:`` model's weights are drawn on ``device``: the same as an
    engine's on that kind of device."""
    cfg = EngineConfig(model=model, dtype="float32", device=device, num_pages=64, hf_overrides=hf_overrides)
    runner = ModelRunner(cfg, load_model_config(model, hf_overrides))
    n = len(ids)
    pages = list(range(-(-n // cfg.page_size)))
    table = torch.tensor([pages], dtype=torch.int32, device=device)
    out = []
    step = chunk or n
    for start in range(0, n, step):
        end = min(n, start + step)
        meta = AttnMetadata(
            positions=torch.arange(start, end, device=device),
            slot_mapping=torch.tensor([pages[p // cfg.page_size] * cfg.page_size + p % cfg.page_size
                                       for p in range(start, end)], device=device),
            block_tables=table, cu_q_lens=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            context_lens=torch.tensor([start], dtype=torch.int32, device=device), is_decode=end - start == 1,
            max_q_len=end - start)
        hidden = runner.model(torch.tensor(ids[start:end], device=device), meta, runner.kv_caches)
        out.append(runner.model.logits(hidden).float().cpu())
    return torch.cat(out)
