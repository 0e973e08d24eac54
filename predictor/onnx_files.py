"""The file names in an encoder predictor's folder: what `odma-train` writes, `predictor.build` rebuilds the graph
from and `predictor.onnx_runtime` serves. Both import them from here, so neither imports the other for them."""

ONNX_FILE = "predictor.onnx"
HEADS_FILE = "heads.safetensors"
TOKENIZER_DIR = "tokenizer"
