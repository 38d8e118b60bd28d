"""An export runs in a process that holds dead weak proxies (torch.compile leaves some behind): the exporter's sweep
of onnxscript's pattern matchers (`_forget_matched_graphs`) asks every object the garbage collector tracks whether it
is a matcher, and for a dead `weakref.proxy` that question raises ReferenceError. The benchmarks export a second
model after a torch.compile side has run; this is that situation, reduced."""

from __future__ import annotations

import gc
import weakref


def test_export_with_a_dead_weak_proxy_in_the_process(tiny_ckpt, tmp_path):
    from txl_deploy.exporters.onnx.export import export_onnx

    class Thing:
        pass

    thing = Thing()
    dead = [weakref.proxy(thing)]
    del thing
    gc.collect()
    assert any(type(o) is weakref.ProxyType for o in gc.get_objects())  # the situation: a dead proxy, tracked
    out = tmp_path / "m.onnx"
    export_onnx(tiny_ckpt, out, max_segment=8, verify=False)
    assert out.stat().st_size > 0 and dead
