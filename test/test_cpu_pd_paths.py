"""The CPU engine's PD changes (patch 0018) leave every other device on 0.5.23's code (issue 79):
each hunk tests for the CPU engine, and the code with that test taken out is the pinned wheel's."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap

from sglang_helix.testing.cpu_env import STUB_DIR

if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)


def test_the_prefills_index_path_off_the_cpu_engine_is_0_5_23s():
    """The CPU engine's prefill sends host indices on the plain path (patch 0018); on every other
    device ``_send_kv_chunk`` is 0.5.23's: its syntax tree, with the CPU-engine term of that one
    condition removed, equals the pinned wheel's."""
    from sglang.srt.disaggregation import prefill
    from sglang_helix.testing.pristine import pristine_module

    upstream = pristine_module("sglang/srt/disaggregation/prefill.py")

    def tree(fn):
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))

    cpu_term = ast.dump(ast.parse('get_device().device != "cpu"', mode="eval").body)

    class DropCpuTerm(ast.NodeTransformer):
        def visit_BoolOp(self, node):
            self.generic_visit(node)
            kept = [v for v in node.values if ast.dump(v) != cpu_term]
            return kept[0] if len(kept) == 1 else ast.BoolOp(op=node.op, values=kept)

    ours = tree(prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk)
    assert cpu_term in ast.dump(ours)
    ours = DropCpuTerm().visit(ours)
    theirs = tree(upstream.SchedulerDisaggregationPrefillMixin._send_kv_chunk)
    assert ast.dump(ours) == ast.dump(theirs)
