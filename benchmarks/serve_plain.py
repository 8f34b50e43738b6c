"""The baseline `serve_load.py` compares with: a plain FastAPI endpoint that calls the model once per
request, no queue and no batching (FastAPI runs each in its thread pool), as most hand-written
model servers do.

    python benchmarks/serve_plain.py MODEL_FOLDER PORT

POST /infer takes the Open Inference Protocol's JSON body of one input ("data" row-major) and
answers the logits; POST /generate takes {"prompt", "max_tokens"} and answers greedy text, with a
KV cache of one sequence (the model's own prefill/decode).
"""

from __future__ import annotations

import sys

import torch
import uvicorn
from fastapi import Body, FastAPI

from gpudl.models.gpt import KVCache
from gpudl.serve.load import load_model


def build(folder: str, device: str = "cpu") -> FastAPI:
    loaded = load_model(folder, device=device)  # the precision gpudl serve picks: the same arithmetic
    model, app = loaded.model, FastAPI()

    @app.get("/v2/health/ready")
    def ready():
        return {"ready": True}

    @app.post("/infer")
    def infer(body: dict = Body(...)):
        given = body["inputs"][0]
        x = torch.tensor(given["data"], dtype=torch.float32).view(given["shape"])
        with torch.inference_mode():
            return {"logits": model(x).tolist()}

    @app.post("/generate")
    def generate(body: dict = Body(...)):
        ids = list(body["prompt"].encode())
        cache = KVCache(model.cfg, 1, loaded.device, loaded.dtype)
        with torch.inference_mode():
            logits = model.prefill(torch.tensor([ids]), cache, 0)
            for _ in range(body["max_tokens"]):
                ids.append(int(logits[-1].argmax()))
                logits = model.decode(torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]), cache)
        return {"text": bytes(ids).decode("utf-8", errors="replace")}
    return app


if __name__ == "__main__":
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    uvicorn.run(build(sys.argv[1], device), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
