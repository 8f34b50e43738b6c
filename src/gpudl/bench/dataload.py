"""Is the data loader the bottleneck? The share of each step spent waiting for data, and what to change.

The data-loading cell trains on the recipe's real data through `DeviceLoader`, exactly as
`gpudl train` does, and counts the time the loop spends inside the loader. Its steps are
compared with the same model on synthetic batches already on the device: the difference is
what loading costs.

>>> advice(0.02, num_workers=0, device_kind="cpu", cores=8)
[]
>>> advice(0.4, num_workers=0, device_kind="cuda", cores=8)[0]
'build batches in more workers: --set data.num_workers=4 (they also pin each batch in the background)'
"""

from __future__ import annotations

# Above this share of step time spent waiting for data, the loader is called the bottleneck.
BOTTLENECK_FRAC = 0.05


def advice(wait_frac: float, num_workers: int, device_kind: str, cores: int) -> list[str]:
    """What to change, most effective first; empty when the loader keeps up."""
    if wait_frac <= BOTTLENECK_FRAC:
        return []
    tips = []
    accelerator = device_kind != "cpu"
    pinned = device_kind in ("cuda", "rocm", "xpu")  # where DeviceLoader pins host batches
    # On the CPU the workers take cores from training itself, so fewer of them pay.
    most = max(1, cores // 2) if accelerator else max(1, cores // 4)
    if num_workers < most:
        pin = " (they also pin each batch in the background)" if pinned else ""
        tips.append(f"build batches in more workers: --set data.num_workers={min(most, 4 if accelerator else 2)}"
                    f"{pin}")
    if pinned and num_workers == 0:
        tips.append("pinned memory: without workers each batch is copied into its pinned buffer on the training "
                    "thread; workers take that off the step")
    tips.append("prefetch: the loader keeps one batch ahead on the device and, with workers, several on the "
                "host; if waits stay, make each batch cheaper: a pre-tokenised file (data.kind=tokens), "
                "smaller images (data.image_size), or JPEGs decoded on the GPU (data.decode)")
    return tips


def verdict(real: dict, synthetic: dict | None, num_workers: int, cores: int) -> dict:
    """The data-loading finding for one model: wait share, slowdown against synthetic data, advice."""
    out = {"model": real["model"], "device": real["device"], "precision": real["precision"],
           "num_workers": num_workers, "status": real["status"], "reason": real["reason"],
           "wait_frac": real["data_wait_frac"], "step_s_p50": real["step_s_p50"],
           "synthetic_step_s_p50": synthetic["step_s_p50"] if synthetic and synthetic["status"] == "ok" else None,
           "slowdown": None, "bottleneck": None, "advice": []}
    if real["status"] != "ok":
        return out
    if out["synthetic_step_s_p50"]:
        out["slowdown"] = real["step_s_p50"] / out["synthetic_step_s_p50"]
    out["bottleneck"] = real["data_wait_frac"] > BOTTLENECK_FRAC
    out["advice"] = advice(real["data_wait_frac"], num_workers, real["device_kind"], cores)
    return out
