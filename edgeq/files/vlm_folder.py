"""The file and tensor names of a vision-language export folder, stated once.

The exports (``edgeq export trained-vlm``, the composed and tiny VLMs) write these files, ``edgeq
compile --static`` carries them into a static deployment (``edgeq.static.vlm``) and ``edgeq eval
vqa`` reads them from either folder, so the names live at the bottom of the engine, where each
of those layers may import them.
"""

from __future__ import annotations

VISION_FILE = "vision.onnx"  # pixels -> visual tokens (backbone and projector)
PIXELS_INPUT = "pixels"  # its input: float32 [batch, S, S, 3], RGB in [0, 1]
VISUAL_OUTPUT = "visual_tokens"  # its output: [batch, tokens, hidden]
EMBED_TABLE_FILE = "embed_tokens.npy"  # the input embedding table [vocab, hidden]: text tokens -> inputs_embeds
QUESTIONS_FILE = "vqa_eval.npz"  # the evaluation questions with their images (edgeq.files.vqa_questions)
