"""The compile pipeline's stage names, in order, and the IR file each is dumped to (``tilec.dump``,
the artifact's ``ir/``). Kept free of heavy imports: the command line's help lists them."""
from __future__ import annotations

STAGE_FILES = {
    "opgraph": "01-opgraph.txt",
    "split_kv": "02-split_kv.txt",
    "fuse_gemv": "03-fuse_gemv.txt",
    "fold_cache": "04-fold_cache.txt",
    "gemv_groups": "05-gemv_groups.txt",
    "tasks": "06-tasks.txt",
    "fused": "07-fused.txt",
    "normalized": "08-normalized.txt",
    "linearized": "09-linearized.txt",
    "schedule": "10-schedule.txt",
    "plan": "11-plan.txt",
}
STAGES = tuple(STAGE_FILES)
OPGRAPH_STAGES = ("opgraph", "split_kv", "fuse_gemv", "fold_cache", "gemv_groups")  # the stages whose IR is an OpGraph
