"""Block-wise compile: memory bounded by one decoder block, not by the model.

The in-memory path imports the whole model into graphsurgeon and calibrates with one onnxruntime
session over all of it: about 8x the model's size at peak, so a 1B model does not fit 24 GB. This
path compiles one decoder block at a time instead:

- ``partition`` splits the input graph (read without its weights) into a prologue (embedding, mask
  and rotary computations), one node set per decoder layer, and an epilogue (final norm, head), and
  checks the split by data flow: each layer reads the residual stream from the layer before it
  (one tensor) plus tensors that do not depend on the stream's values (masks, rotary tables), and
  the epilogue reads the last layer's output. A graph that does not split this way is refused
  (``NotPartitionable``) and the compiler uses the in-memory path.
- ``block_model`` builds, for layer i, a one-layer model: prologue -> layer i -> epilogue, its
  weights read from the external data file for that block only. Between the first and the last
  block the embedding and head tables are small stand-ins (the block's calibration feeds the
  carried hidden states to the layer directly, and the stand-ins' rewrites are thrown away).
- the recipe's passes run on that model unchanged (every pass declares ``per_block``); calibration
  feeds the layer with the hidden states the previous block produced, one set per calibration
  request (``edgeq.calib.session.StreamCarry``), so the statistics are the in-memory path's.
- ``Assembler`` takes the block's nodes out of the result (a data-flow walk from the block's output
  back to the prologue's tensors), renames what would clash with earlier blocks, writes the large
  initializers straight into the output's external data file and keeps only the graph. The
  prologue comes from the first block's result, the epilogue from the last's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

import numpy as np
import onnx

from edgeq.passmanager.passbase import Combine
from edgeq.passmanager.records import PassRecord
from edgeq.blockwise.assemble import Assembler, ancestors
from edgeq.blockwise.block import block_graph, block_model
from edgeq.blockwise.partition import NotPartitionable, Partition, partition

__all__ = ["NotPartitionable", "Partition", "partition", "block_graph", "block_model", "compile_blocks",
           "merge_records", "BlockProgress", "ancestors"]


@dataclass
class BlockProgress:
    """One stderr line per block: elapsed time and an estimate of what is left."""

    total: int
    enabled: bool
    started: float = field(default_factory=time.perf_counter)

    def done(self, i: int, seconds: float, rss_mb: float) -> None:
        if not self.enabled:
            return
        import sys

        elapsed = time.perf_counter() - self.started
        eta = elapsed / (i + 1) * (self.total - i - 1)
        sys.stderr.write(f"block {i + 1}/{self.total}: {seconds:.1f} s, elapsed {_clock(elapsed)}, "
                         f"ETA {_clock(eta)}, peak RSS {rss_mb:.0f} MB\n")
        sys.stderr.flush()


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def compile_blocks(skeleton: onnx.ModelProto, part: Partition, base_dir: Path, data_path: Path,
                   run_block: Callable[[object, int], tuple[onnx.ModelProto, list[PassRecord]]],
                   carry, progress: BlockProgress, probe_feeds: dict | None = None) -> tuple[onnx.ModelProto, list[list[PassRecord]], dict]:
    """Compile every block with ``run_block(graph, i) -> (compiled model, pass records)``; returns
    the assembled model (large initializers already in ``data_path``), the records per block and
    the u8s8 report of its linears (``U8S8Tally``: probed on ``probe_feeds``, else the bound).

    ``carry``: the calibrator's ``StreamCarry`` (None without calibration), moved on per block."""
    from edgeq.runtime.peak_rss import peak_rss_mb

    last = part.num_layers - 1
    head_side = _head_side(skeleton, part) if last > 0 else set()
    assembler = Assembler(skeleton, data_path)
    records = []
    u8s8 = U8S8Tally(probe_feeds)
    try:
        for i in range(part.num_layers):
            start = time.perf_counter()
            if carry is not None and i > 0:
                carry.advance(cut=part.stream[0], capture=part.stream[i + 1])
            compiled, recs = run_block(block_graph(skeleton, part, i, base_dir), i)
            records.append(recs)
            _check_present(compiled, [part.stream[i + 1], *part.layer_outputs[i]] + ([part.stream[0]] if i > 0 else []), i)
            base = set(part.prologue_outputs) | {o for k in part.support[i] for o in skeleton.graph.node[k].output}
            base |= {t.name for t in skeleton.graph.input}
            if i == 0:  # (a prologue tensor the passes made unused, a tied head's Transpose, may be gone)
                assembler.add(compiled, ancestors(compiled, [o for o in part.prologue_outputs if o not in head_side],
                                                  {t.name for t in skeleton.graph.input}), {}, "prologue")
            targets = [part.stream[i + 1], *sorted(part.exported_support[i]), *part.layer_outputs[i]]
            block = ancestors(compiled, targets, base | {part.stream[0]})
            kept = {n.name for n in block}
            if i == 0:
                kept |= {n.name for n in ancestors(compiled, part.prologue_outputs, set())}
            if i == last:
                kept |= {n.name for n in ancestors(compiled, [o.name for o in skeleton.graph.output], set())}
            u8s8.add(compiled, kept, part.stream[0] if i > 0 else None, part.stream[i + 1])
            discarded = ({skeleton.graph.node[k].name for k in part.prologue} if i > 0 else set()) | (
                {skeleton.graph.node[k].name for k in part.epilogue} if i < last else set())
            assembler.add_metadata(compiled, {name for name in discarded if name})
            assembler.add_missing(compiled, block, f"p{i}")
            assembler.add(compiled, block, {part.stream[0]: part.stream[i]} if i > 0 else {}, f"b{i}")
            if i == last:
                stop = set(part.prologue_outputs) - head_side | {part.stream[-1]} | {t.name for t in skeleton.graph.input}
                stop |= {name for s in part.exported_support for name in s}
                epilogue = ancestors(compiled, [o.name for o in skeleton.graph.output], stop)
                assembler.add_missing(compiled, epilogue, "pe")
                assembler.add(compiled, epilogue, {}, "epilogue")
            # nothing may keep a node of this block's model: any part keeps all of it alive
            del compiled, block, recs
            release_memory()
            progress.done(i, time.perf_counter() - start, peak_rss_mb())
        return assembler.finish(), records, u8s8.summary()
    finally:
        assembler.close()


def _head_side(skeleton: onnx.ModelProto, part: Partition) -> set[str]:
    """Prologue outputs only the epilogue reads (a tied head's transposed table): the first block
    computes them from a stand-in, so they are taken from the last block, with the real head."""
    nodes = skeleton.graph.node
    inner = {k for ks in part.layers + part.support for k in ks}
    layer_reads = {x for k in inner for x in nodes[k].input}
    epilogue_reads = {x for k in part.epilogue for x in nodes[k].input}
    return {o for o in part.prologue_outputs if o in epilogue_reads and o not in layer_reads}


@dataclass
class U8S8Tally:
    """What report.json says about onnxruntime's uint8 x int8 kernels, taken block by block while
    each block's weights are in memory (the writer then need not read the whole output back).

    With ``feeds`` (the probe's calibration batch) every block's linears are probed as
    ``edgeq.targets.u8s8_sites.probe_saturation`` probes the whole model: the compiled block runs
    on the hidden states the previous compiled block produced (``stream``), so the records are the
    in-memory path's. Without, the worst-case bound only."""

    feeds: dict | None = None
    per_linear: dict[str, dict] = field(default_factory=dict)
    stream: np.ndarray | None = None  # the compiled model's hidden states after the last block probed
    linears: int = 0
    at_risk: dict[str, int] = field(default_factory=dict)

    def add(self, compiled: onnx.ModelProto, nodes: set[str], cut: str | None, capture: str) -> None:
        from edgeq.targets.u8s8_sites import find_u8s8_sites, probe_linears, static_risk

        if self.feeds is not None:
            records, self.stream = probe_linears(compiled, self.feeds, nodes=nodes, stream=(cut, capture),
                                                 stream_value=self.stream)
            self.per_linear.update(records)
            return
        import onnx_graphsurgeon as gs

        sites = [s for s in find_u8s8_sites(gs.import_onnx(compiled)) if s.node.name in nodes]
        self.linears += len(sites)
        self.at_risk.update(static_risk(sites))

    def summary(self) -> dict:
        from edgeq.targets.u8s8_sites import summarize_probe

        if self.feeds is not None:
            return summarize_probe(self.per_linear)
        return {"linears": self.linears, "linears_at_risk": len(self.at_risk), "saturation_free": not self.at_risk,
                "at_risk": self.at_risk, "note": "no calibration data: worst-case bound only, no saturation rates"}


def release_memory() -> None:
    """Give freed memory back to the system between blocks: collect cycles, and ask glibc to
    return its free heap (block-sized arrays freed in the middle of the heap otherwise stay in the
    process's RSS and the next block's add up on top). A no-op where there is no glibc."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _check_present(model: onnx.ModelProto, names: list[str], i: int) -> None:
    have = {o for n in model.graph.node for o in n.output} | {t.name for t in model.graph.input}
    missing = [n for n in names if n not in have]
    if missing:
        raise RuntimeError(f"block {i}: the passes removed the tensor(s) {missing[:3]} the block-wise compile stitches "
                           "blocks at; compile with --blockwise off")


def merge_records(per_block: list[list[PassRecord]]) -> list[PassRecord]:
    """One record per pass for report.json: seconds summed over blocks, peak RSS the highest,
    summaries merged by the pass's ``combine=`` rules (``Combine``; undeclared figures: numbers
    summed, lists joined), and how many blocks the pass changed. A pass that changed some blocks and
    did not apply to others is recorded as modified, its reason for the others counted in
    ``blocks_not_applicable`` rather than left in the summary beside ``modified``."""
    from edgeq.passmanager.registry import get_pass

    merged = []
    for recs in zip(*per_block):
        first = recs[0]
        rules = get_pass(first.name).summary_combine
        summaries = [r.summary for r in recs]
        summary = {}
        for key in dict.fromkeys(k for s in summaries for k in s):
            values = [s[key] for s in summaries if key in s]
            summary[key] = _combine(rules[key], values) if key in rules else _merge(values, key)
        modified = any(r.modified for r in recs)
        na = [r.not_applicable for r in recs if r.not_applicable is not None]
        blocks_na = None
        if modified and na:
            summary.pop("not_applicable", None)
            blocks_na = len(na)
        scope = None
        if len(recs) > 1:
            scope = (f"summed over {len(recs)} block models (a max_/min_/mean_ figure: the blocks' max, min or "
                     "mean), each the prologue, one layer and the epilogue: what a pass counts in the embedding, "
                     "final norm and head (or their stand-ins) is counted once per block")
        merged.append(dataclasses.replace(
            first, seconds=round(sum(r.seconds for r in recs), 3), peak_rss_mb=max(r.peak_rss_mb for r in recs),
            modified=modified, blocks_modified=sum(bool(r.modified) for r in recs),
            ops_added=_merge([r.ops_added for r in recs]), ops_removed=_merge([r.ops_removed for r in recs]),
            summary=summary, blocks_not_applicable=blocks_na, summary_scope=scope,
            not_applicable=na[0] if na and len(na) == len(recs) else None))
    return merged


def _combine(rule: Combine, values: list):
    """``values`` (one per block) combined by a pass's declared rule (a dict's figures each by it)."""
    if values and all(isinstance(v, dict) for v in values) and rule is not Combine.FIRST:
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _combine(rule, [v[k] for v in values if k in v]) for k in keys}
    if rule is Combine.FIRST:
        return values[0]
    if rule is Combine.ANY:
        return any(values)
    if rule is Combine.CONCAT:
        return [x for v in values for x in v]
    if rule is Combine.MAX:
        return max(values)
    if rule is Combine.MIN:
        return min(values)
    if rule is Combine.MEAN:
        return round(sum(values) / len(values), 6)
    return round(sum(values), 6)


def _merge(values: list, key: str = ""):
    """``values`` (one per block) as one: a count summed, but a number named as an extreme
    (``max_*`` / ``*_max``, ``min_*`` / ``*_min``) its extreme over the blocks and one named as a
    mean (``mean_*`` / ``*_mean``) the blocks' unweighted mean: summing those would be meaningless."""
    if all(isinstance(v, bool) for v in values):
        return any(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        if key.startswith("max_") or key.endswith("_max"):
            return max(values)
        if key.startswith("min_") or key.endswith("_min"):
            return min(values)
        if key.startswith("mean_") or key.endswith("_mean"):
            return round(sum(values) / len(values), 6)
        return round(sum(values), 6)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge([v[k] for v in values if k in v], k) for k in keys}
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    distinct = list(dict.fromkeys(map(str, values)))
    return values[0] if len(distinct) == 1 else distinct
