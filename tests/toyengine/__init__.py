"""A toy engine, made for tests/test_toyengine.py: its C library's toy_decode calls are the
token level, its toy_op calls the op level. Found through PROFINFER_PLUGINS=toyengine."""
from profinfer.core.base.registry import Engine

PLUGIN = Engine("toyengine", __name__, title="toy engine", bpf="toyengine.bpf.c",
                collector="collector:ToyCollector", capabilities=frozenset({"tokens_by_process"}))
