"""Per-device launch configs (kernels/tuning.py): the file format, its checks, the launchers' overrides."""

import json

import pytest
import torch

from kernels import reference as ref
from kernels import tuning
from kernels.testing import make_paged_kv, reference_error_rule

pytest.importorskip("triton")


def test_config_files_are_checked_and_read_by_shape_class(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning._load.cache_clear()
    good = {"prefill": {"D128-bfloat16-large": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2}},
            "decode": {"D128-bfloat16": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}}}
    (tmp_path / "GPU_A.json").write_text(json.dumps(good))
    assert tuning._load("GPU_A") == good
    assert tuning._load("GPU_B") == {}  # no file: the built-in tables
    (tmp_path / "GPU_C.json").write_text(json.dumps({"decode": {"D128-bfloat16": {"BLOCK_N": 64, "num_warps": 4}}}))
    with pytest.raises(ValueError, match="bad decode config"):
        tuning._load("GPU_C")
    (tmp_path / "GPU_D.json").write_text(json.dumps({"prefill": {"x": {"BLOCK_M": 0, "BLOCK_N": 64, "num_warps": 4,
                                                                       "num_stages": 3}}}))
    with pytest.raises(ValueError, match="positive ints"):
        tuning._load("GPU_D")
    tuning._load.cache_clear()
    assert tuning.variant(128, torch.bfloat16, long_chunks=True) == "D128-bfloat16-large"
    assert tuning.variant(64, torch.float16, long_chunks=False) == "D64-float16-small"
    assert tuning.variant(128, torch.bfloat16) == "D128-bfloat16"
    assert tuning.lookup("prefill", torch.device("cpu"), "D128-bfloat16-large") is None
    assert tuning.device_key(torch.device("cpu")) == "cpu"


def test_the_launchers_take_a_whole_config():
    from kernels.decode_attention import paged_decode_attention
    from kernels.prefill_attention import chunked_prefill_attention

    paged = make_paged_kv([70, 33], 2, 64, 16, torch.float16, seed=4)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 64, generator=g).half()
    seq_lens = torch.tensor([70, 33], dtype=torch.int32)
    args = (paged.block_tables, seq_lens, 0.125)
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, *args,
                                 config={"BLOCK_N": 32, "num_warps": 4, "num_stages": 1})
    ok, err, ref_err = reference_error_rule(out, ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args),
                                            ref.paged_decode_attention(q, paged.k_cache, paged.v_cache, *args,
                                                                       upcast=False))
    assert ok, (err, ref_err)
    qp = torch.randn(20, 8, 64, generator=g).half()
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    ctx = torch.tensor([58, 25], dtype=torch.int32)
    pargs = (paged.k_cache, paged.v_cache, paged.block_tables, cu, ctx, 0.125)
    out = chunked_prefill_attention(qp, *pargs, config={"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4,
                                                        "num_stages": 1})
    ok, err, ref_err = reference_error_rule(out, ref.chunked_prefill_attention(qp, *pargs),
                                            ref.chunked_prefill_attention(qp, *pargs, upcast=False))
    assert ok, (err, ref_err)
