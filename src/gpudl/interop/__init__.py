"""The way out and in: gpudl's models in the layouts other engines read (Hugging Face, ONNX, Triton) and
weights other tools wrote brought into gpudl's models."""
