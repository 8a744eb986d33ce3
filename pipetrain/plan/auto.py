"""parallel.auto: fill every parallel key the recipe does not fix with the planner's best layout at launch.

Semi-auto: a key given in the recipe file or with --set is kept; the search (search.py) runs over the rest.
The choice is a pure function of the recipe, the world size and the device profile. Each rank measures its own
profile (launch_profile), and nodes can differ (a CPU rank's memory is its node's RAM over its ranks): planned
apart, two ranks could pick different layouts and hang in the first collective. So the ranks first agree on
one profile (agree_profile: rank 0's, with the smallest memory of any rank), and every rank plans from it.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import yaml

from pipetrain.config import ConfigError, Recipe, parse_override
from pipetrain.parallel.mesh.comm import all_gather_object, process_count
from pipetrain.plan.devices import DEVICES, GIB, DeviceProfile, load_profile
from pipetrain.plan.search import KEYS, Plan, apply_layout, nothing_fits, refused_by_rules, search
from pipetrain.shipped import recipe_file

# torch.cuda.get_device_name substrings -> DEVICES entries, the first match wins: a name that holds another's
# key comes before it ("H100 PCIe" before "H100", "L40S" before "L4"; "GH200" holds "H200")
_CUDA_NAMES = (("H100 PCIe", "h100-pcie-80gb"), ("H100", "h100-sxm-80gb"), ("H200", "h200-141gb"),
               ("A100-SXM4-40GB", "a100-40gb"), ("A100", "a100-80gb"), ("L40S", "l40s"), ("L4", "l4"),
               ("4090", "rtx-4090"), ("MI300X", "mi300x"))


def fixed_parallel_keys(recipe_path: str | None, overrides=()) -> dict:
    """Parallel search keys set explicitly in the recipe file (if given) or by --set overrides, with values."""
    fixed = {}
    if recipe_path:
        with open(recipe_file(recipe_path) or recipe_path) as f:  # a shipped recipe's name reads its file
            raw = yaml.safe_load(f) or {}
        fixed.update({k: v for k, v in ((raw.get("parallel") or {}).items()) if k in KEYS})
    for text in overrides:
        section, key, value = parse_override(text)
        if section == "parallel" and key in KEYS:
            fixed[key] = value
    return fixed


def launch_profile(world_size: int, ranks_per_node: int | None = None) -> DeviceProfile:
    """The profile of the device this process runs on: a CUDA card's table entry by name (cuda_profile), else
    "cpu" with the node's physical memory shared by its ranks. PIPETRAIN_DEVICE (a DEVICES name or profile
    file) overrides it."""
    if os.environ.get("PIPETRAIN_DEVICE"):
        return load_profile(os.environ["PIPETRAIN_DEVICE"], "PIPETRAIN_DEVICE")
    if torch.cuda.is_available():
        return cuda_profile(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_node = ranks_per_node or world_size
    cpu = DEVICES["cpu"]
    return DeviceProfile(**{**cpu.as_dict(), "memory_bytes": float(memory) / per_node})


def cuda_profile(name: str, total_memory: float) -> DeviceProfile:
    """The DEVICES entry of the CUDA card called name, its memory capped at total_memory, what the card reports
    (a MIG slice, a smaller variant); ConfigError for a card the table does not hold, which no CPU figure fits."""
    for key, entry in _CUDA_NAMES:
        if key in name:
            profile = DEVICES[entry]
            return dataclasses.replace(profile, memory_bytes=min(profile.memory_bytes, float(total_memory)))
    cards = ", ".join(entry for _, entry in _CUDA_NAMES)
    raise ConfigError(f"parallel.auto: no device profile for the GPU {name!r}; set PIPETRAIN_DEVICE to the closest of "
                      f"{cards} or to a profile JSON file, or set parallel.auto=false and the layout by hand")


def agree_profile(profile: DeviceProfile, num_processes: int) -> DeviceProfile:
    """The one profile every process plans from: rank 0's, with memory_bytes the smallest over every process
    (the plan must fit the smallest rank). A collective over the default group: every process calls it."""
    mine = profile.as_dict()
    everyone = all_gather_object(mine, num_processes)
    memory = min(p["memory_bytes"] for p in everyone)
    agreed = {**everyone[0], "memory_bytes": memory}
    if agreed != everyone[0]:
        agreed["source"] = f"{everyone[0]['source'] or everyone[0]['name']}; memory: smallest of {num_processes} ranks"
    return DeviceProfile(**agreed)


def resolve_auto(recipe: Recipe, world_size: int, fixed: dict, profile: DeviceProfile,
                 ranks_per_node: int | None = None) -> tuple[Recipe, Plan]:
    """recipe with the best plan's layout; ConfigError naming the fix when nothing fits or divides."""
    result = search(recipe, world_size, profile, fixed, ranks_per_node)
    if not result.plans:
        refused = refused_by_rules(result, world_size, fixed)
        raise ConfigError(f"parallel.auto: {refused or nothing_fits(recipe, world_size, profile, fixed)}")
    best = result.plans[0]
    return apply_layout(recipe, best.layout), best


def describe(plan: Plan, world_size: int, profile: DeviceProfile, fixed: dict) -> str:
    """Two lines for the launch log: the choice and its predicted figures."""
    layout = " ".join(f"{k}={v}" for k, v in plan.layout.items())
    peak = max(plan.workers, key=lambda r: r.total)
    t = plan.time
    return (f"parallel.auto on {world_size} x {profile.name} (fixed: {fixed or 'none'}): {layout}\n"
            f"  predicted: {peak.total / GIB:.2f} GiB peak per rank (params {peak.params / GIB:.2f}, grads "
            f"{peak.grads / GIB:.2f}, optim {peak.optim / GIB:.2f}, act {peak.activations / GIB:.2f}, comm "
            f"{peak.comm / GIB:.2f}); step {t.total:.3g}s (bubble {t.bubble_fraction:.0%}), "
            f"{t.tokens_per_s:,.0f} tokens/s")


def resolve_at_launch(recipe: Recipe, recipe_path: str, overrides, world_size: int, rank: int,
                      free=()) -> Recipe:
    """The CLI's hook: with parallel.auto, plan and print the choice (rank 0); otherwise recipe unchanged.
    free: parallel keys searched even where the recipe fixes them (dp on an elastic resume: pipetrain.elastic)."""
    if not recipe.parallel.auto:
        return recipe
    fixed = {k: v for k, v in fixed_parallel_keys(recipe_path, overrides).items() if k not in free}
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # every process (servers included) takes part: the CLI initialises torch.distributed before planning
    profile = agree_profile(launch_profile(world_size, ranks_per_node), process_count())
    resolved, plan = resolve_auto(recipe, world_size, fixed, profile, ranks_per_node)
    if rank == 0:
        print(describe(plan, world_size, profile, fixed), flush=True)
    return resolved
