"""libbpf (Debian libbpf1) loaded by ctypes, its functions typed, and its messages kept:
the last ones become the text of a failure's error (`failure`), so a failure is one line."""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os

from profinfer.core.base.errors import ProfinferError

vp = ctypes.c_void_p
SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_size_t)
PERF_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int, vp, ctypes.c_int, vp)
PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, vp)

messages: collections.deque[str] = collections.deque(maxlen=40)
_lib = None
libc = ctypes.CDLL(None, use_errno=True)


# one buffer for every message (libbpf prints from the thread that called it): large, since a
# verifier log ends with its verdict
_print_buf = ctypes.create_string_buffer(1 << 18)


def _on_print(level, fmt, ap):
    libc.vsnprintf(_print_buf, len(_print_buf), fmt, vp(ap))
    text = _print_buf.value.decode("utf-8", "replace").rstrip()
    if text:
        messages.append(text)
    return 0


_print_cb = PRINT_FN(_on_print)


class UprobeOpts(ctypes.Structure):
    """struct bpf_uprobe_opts up to retprobe (libbpf 0.8 on; libbpf takes sz as the version)."""
    _fields_ = [("sz", ctypes.c_size_t), ("ref_ctr_offset", ctypes.c_size_t),
                ("bpf_cookie", ctypes.c_uint64), ("retprobe", ctypes.c_bool)]


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        L = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise ProfinferError("libbpf is missing: apt-get install libbpf1") from None
    sigs = {
        "libbpf_set_print": (vp, [PRINT_FN]),
        "libbpf_version_string": (ctypes.c_char_p, []),
        "bpf_object__open_file": (vp, [ctypes.c_char_p, vp]),
        "bpf_object__load": (ctypes.c_int, [vp]),
        "bpf_object__close": (None, [vp]),
        "bpf_object__find_map_by_name": (vp, [vp, ctypes.c_char_p]),
        "bpf_object__find_program_by_name": (vp, [vp, ctypes.c_char_p]),
        "bpf_object__next_program": (vp, [vp, vp]),
        "bpf_program__name": (ctypes.c_char_p, [vp]),
        "bpf_program__section_name": (ctypes.c_char_p, [vp]),
        "bpf_program__set_autoload": (ctypes.c_int, [vp, ctypes.c_bool]),
        "bpf_program__fd": (ctypes.c_int, [vp]),
        "bpf_enable_stats": (ctypes.c_int, [ctypes.c_int]),
        "bpf_obj_get_info_by_fd": (ctypes.c_int, [ctypes.c_int, vp, ctypes.POINTER(ctypes.c_uint32)]),
        "bpf_program__attach_uprobe": (vp, [vp, ctypes.c_bool, ctypes.c_int, ctypes.c_char_p,
                                             ctypes.c_size_t]),
        "bpf_program__attach_uprobe_opts": (vp, [vp, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.POINTER(UprobeOpts)]),
        "bpf_program__attach": (vp, [vp]),
        "bpf_program__set_expected_attach_type": (ctypes.c_int, [vp, ctypes.c_int]),
        "bpf_link__destroy": (ctypes.c_int, [vp]),
        "bpf_map__fd": (ctypes.c_int, [vp]),
        "bpf_map__key_size": (ctypes.c_uint32, [vp]),
        "bpf_map__value_size": (ctypes.c_uint32, [vp]),
        "bpf_map__set_max_entries": (ctypes.c_int, [vp, ctypes.c_uint32]),
        "bpf_map__reuse_fd": (ctypes.c_int, [vp, ctypes.c_int]),
        "bpf_map__initial_value": (vp, [vp, ctypes.POINTER(ctypes.c_size_t)]),
        "bpf_map_lookup_elem": (ctypes.c_int, [ctypes.c_int, vp, vp]),
        "bpf_map_create": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32,
                                          ctypes.c_uint32, ctypes.c_uint32, vp]),
        "bpf_map_update_elem": (ctypes.c_int, [ctypes.c_int, vp, vp, ctypes.c_uint64]),
        "bpf_map_get_next_key": (ctypes.c_int, [ctypes.c_int, vp, vp]),
        "bpf_obj_pin": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]),
        "bpf_obj_get": (ctypes.c_int, [ctypes.c_char_p]),
        "bpf_map_delete_elem": (ctypes.c_int, [ctypes.c_int, vp]),
        "ring_buffer__new": (vp, [ctypes.c_int, SAMPLE_FN, vp, vp]),
        "ring_buffer__poll": (ctypes.c_int, [vp, ctypes.c_int]),
        "ring_buffer__consume": (ctypes.c_int, [vp]),
        "ring_buffer__free": (None, [vp]),
        "ring_buffer__epoll_fd": (ctypes.c_int, [vp]),
        "perf_buffer__new_raw": (vp, [ctypes.c_int, ctypes.c_size_t, vp, PERF_EVENT_FN, vp, vp]),
        "perf_buffer__poll": (ctypes.c_int, [vp, ctypes.c_int]),
        "perf_buffer__consume": (ctypes.c_int, [vp]),
        "perf_buffer__free": (None, [vp]),
        "perf_buffer__epoll_fd": (ctypes.c_int, [vp]),
    }
    for fn, (res, args) in sigs.items():
        f = getattr(L, fn)
        f.restype, f.argtypes = res, args
    L.libbpf_set_print(_print_cb)
    _lib = L
    return L


def version() -> str:
    return lib().libbpf_version_string().decode()


def failure(what: str) -> ProfinferError:
    err = ctypes.get_errno()
    detail = os.strerror(err) if err else "failed"
    # The verifier's verdict is usually the last message before libbpf's own summary.
    logs = [m for m in messages if m and not m.startswith("libbpf: prog '") or "failed" in m]
    tail = f" [{logs[-1][:300]}]" if logs else ""
    return ProfinferError(f"{what}: {detail}{tail}")
