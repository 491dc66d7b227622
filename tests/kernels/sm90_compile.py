"""Compiles every Triton kernel for Hopper (sm_90) on a machine without a GPU.

Run as a script (not collected by pytest; test_kernels_compile.py runs it in a
subprocess, since the test process has TRITON_INTERPRET=1). Uses the launchers'
own tile configs and mimics the JIT's argument specialization (16-byte aligned
pointers, strides of 1 as constants, other strides multiples of 16), so the IR
is the one a real launch on an H100/H200 would build. Prints one line per
kernel: ``name variant async_copies=N wgmma=N ld16=N st16=N shared=BYTES regs=N
stack=BYTES`` (ld16/st16: 16-byte global loads/stores in the PTX; regs and
stack, the per-thread registers and local-memory frame of the cubin, from the
bundled cuobjdump, ``NA`` without it). A stack frame means registers spilled:
every tile then round-trips through local memory.

NOTE: this stops at the cubin, which the bundled ptxas builds; it proves the
kernels compile, that their loops are software-pipelined (cp.async), use wgmma
and do not spill, not how fast they run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode_attention, fp8, kv_pages, prefill_attention, tuning  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUDA = torch.device("cuda")  # only its .type is read by the launch configs
ONES = {"stride_qd", "stride_od", "stride_btp", "stride_cd", "stride_xd"}
NOT_MULTIPLE_OF_16 = {"stride_btb"}  # max_pages: any value
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_kernel(fn, variant, ptr_types, constexprs, floats=(), num_warps=4, num_stages=3, i64s=(), plain=()):
    """``i64s``: 64-bit integer arguments; ``plain``: arguments the kernel does not specialize on."""
    sig, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in ONES:
            constexprs[name] = 1
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        elif name in i64s:
            sig[name] = "i64"
        elif name in plain:
            sig[name] = "i32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in NOT_MULTIPLE_OF_16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET, options=opts)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    print(
        f"{fn.__name__} {variant} async_copies={ttgir.count('async_copy_global_to_local')} "
        f"wgmma={ttgir.count('warp_group_dot ')} "
        f"ld16={ptx.count('ld.global.v4.b32') + ptx.count('ld.global.v2.b64')} "
        f"st16={ptx.count('st.global.v4.b32') + ptx.count('st.global.v2.b64')} shared={kernel.metadata.shared} "
        f"{resource_usage(kernel.asm['cubin'])}",
        flush=True,
    )


def resource_usage(cubin: bytes) -> str:
    """``regs=N stack=BYTES`` of the cubin's one kernel (``cuobjdump -res-usage``)."""
    if not CUOBJDUMP.exists():
        return "regs=NA stack=NA"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    # e.g. "REG:176 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:648 ..."
    usage = dict(field.split(":", 1) for line in out.splitlines() if "REG:" in line for field in line.split())
    return f"regs={usage['REG']} stack={usage['STACK']}"


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        dt = TL_DTYPES[dtype]
        flags = {"INTERPRET": False, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
        attn_ptrs = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "bt_ptr": "*i32", "out_ptr": f"*{dt}"}
        for head_dim in (32, 64, 128, 256):  # random:small's 32, Llama's 64 and 128, Gemma's 256
            for max_q_len in (8192, 16):  # long prompt chunks; a few queries (speculative verify)
                cfg = prefill_attention._launch_config(head_dim, dtype, CUDA, max_q_len=max_q_len)
                num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
                compile_kernel(
                    prefill_attention._chunked_prefill_kernel, f"{dt}-D{head_dim}-q{max_q_len}",
                    {**attn_ptrs, "cu_q_ptr": "*i32", "ctx_ptr": "*i32"},
                    {"GROUP": 4, "HEAD_DIM": head_dim, "PAGE_SIZE": 16, **cfg, **flags},
                    floats=("qk_scale",), num_warps=num_warps, num_stages=num_stages,
                )  # fmt: skip
            cfg = decode_attention._launch_config(dtype, CUDA, head_dim)
            num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            for splits in (1, 4) if head_dim == 128 else (4,):
                compile_kernel(
                    decode_attention._decode_split_kernel, f"{dt}-D{head_dim}-splits{splits}",
                    {**attn_ptrs, "seq_lens_ptr": "*i32", "mid_acc_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32"},
                    {"NUM_HEADS": 32, "GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": head_dim, "PAGE_SIZE": 16,
                     "SPLIT": splits > 1, **cfg, **flags},
                    floats=("qk_scale",), num_warps=num_warps, num_stages=num_stages,
                )  # fmt: skip
        if dtype == torch.bfloat16:  # the candidates bench/kernels_bench.py --sweep times (D=128)
            for i, cfg in enumerate(tuning.GRIDS["prefill"]):
                cfg = dict(cfg)
                num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
                compile_kernel(
                    prefill_attention._chunked_prefill_kernel, f"sweep{i}-{dt}-D128",
                    {**attn_ptrs, "cu_q_ptr": "*i32", "ctx_ptr": "*i32"},
                    {"GROUP": 4, "HEAD_DIM": 128, "PAGE_SIZE": 16, **cfg, **flags},
                    floats=("qk_scale",), num_warps=num_warps, num_stages=num_stages,
                )  # fmt: skip
            for i, cfg in enumerate(tuning.GRIDS["decode"]):
                cfg = dict(cfg)
                num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
                compile_kernel(
                    decode_attention._decode_split_kernel, f"sweep{i}-{dt}-D128",
                    {**attn_ptrs, "seq_lens_ptr": "*i32", "mid_acc_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32"},
                    {"NUM_HEADS": 32, "GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": 128, "PAGE_SIZE": 16, "SPLIT": True,
                     **cfg, **flags},
                    floats=("qk_scale",), num_warps=num_warps, num_stages=num_stages,
                )  # fmt: skip
        compile_kernel(
            decode_attention._decode_reduce_kernel, dt,
            {"mid_acc_ptr": "*fp32", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": f"*{dt}"},
            {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_S": 4, "BLOCK_N": 64, "INTERPRET": False},
            num_stages=1,
        )  # fmt: skip
        for scatter in (False, True):
            compile_kernel(
                kv_pages._kv_pages_kernel, f"{dt}-{'scatter' if scatter else 'gather'}",
                {"table_ptr": "*i64", "page_ids_ptr": "*i32", "chunk_ptr": f"*{dt}"},
                {"PAGE_SIZE": 16, "HEAD_DIM": 128, "BLOCK_S": 16, "BLOCK_D": 128, "SCATTER": scatter, "ALIGNED": True},
            )  # fmt: skip
        for checksum in (False, True):  # the landing kernel (moves 8-byte words: one variant serves every dtype)
            if dtype != torch.bfloat16:
                break
            compile_kernel(
                kv_pages._kv_layer_kernel, "wsum" if checksum else "copy",
                {"src_table_ptr": "*i64", "cache_table_ptr": "*i64", "page_ids_ptr": "*i32", "shares_ptr": "*i64"},
                {"PAGE_SIZE": 16, "ROW_WORDS": 32, "BLOCK_S": 16, "BLOCK_W": 32, "CHECKSUM": checksum, "ALIGNED": True},
                i64s=("wsum_k",), plain=("offset_words", "wsum_at", "tokens", "num_heads", "stride_pn"),
            )  # fmt: skip
        compile_kernel(
            fp8._quantize_kernel, dt, {"x_ptr": f"*{dt}", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"},
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "FP8_MAX": 448.0, "BLOCK_T": fp8._block_t(128), "BLOCK_D": 128},
        )  # fmt: skip
        compile_kernel(
            fp8._dequantize_kernel, dt, {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": f"*{dt}"},
            {"NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_T": fp8._block_t(128), "BLOCK_D": 128, "INTERPRET": False},
        )  # fmt: skip


if __name__ == "__main__":
    main()
