"""A static pair's prefill graph on the HTP against onnxruntime CPU over the first --tokens WikiText-2 test
tokens (issue 43 item 5's measure): relative L2 of the logits, top-1 agreement, largest difference.

Usage: python benchmarks/htp_logits.py PAIR --tokenizer DIR [--tokens 128] [--out F]
(PAIR: a folder from ``edgeq compile --static ... --target qnn-htp``; the HTP prepares it from the ONNX
graph unless the folder has context binaries: minutes on an x86-64 emulator)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


from qnn_htp import _windows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from edgeq.evaluate.machine import machine_info
    from edgeq.generation.decoders import open_decoder
    from edgeq.generation.teacher_forced import window_logits

    ids = _windows(args.tokenizer, 1, args.tokens)
    started = time.perf_counter()
    cpu, htp = open_decoder(args.pair), open_decoder(args.pair, provider="qnn-htp")
    a = window_logits(cpu, ids[0], "prefill").astype(np.float64)
    b = window_logits(htp, ids[0], "prefill").astype(np.float64)
    out = {"pair": str(args.pair), "tokens": args.tokens, "command": " ".join(["python", *sys.argv]),
           "relative_l2": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
           "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
           "max_abs_logit_diff": float(np.abs(a - b).max()), "max_abs_logit": float(np.abs(a).max()),
           "seconds": round(time.perf_counter() - started, 1), "machine": machine_info()}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
