"""Per-domain expert subsets (EMO §4.2, §5.2): select, save/load, export a smaller checkpoint.

keep = select_subset(model, input_ids, k=4, method="router", attention_mask=mask)
save_subset("math.subset.json", keep, model="tiny:olmoe", method="router", calibration={...})
export_subset(model, load_subset("math.subset.json", info).keep, "math-4/")
finetune_subset(subset_model, tokenizer, read_examples("math_train.jsonl"))   # EMO appendix C
merge_subset(model, subset_model, keep)                                        # EMO §6
"""

from moectl.subsets.export import export_subset
from moectl.subsets.files import SubsetFile, load_subset, save_subset
from moectl.subsets.finetune import FinetuneConfig, finetune_subset
from moectl.subsets.finetune_data import read_examples
from moectl.subsets.merge import merge_subset
from moectl.subsets.select import METHODS, select_subset

__all__ = [
    "METHODS",
    "FinetuneConfig",
    "SubsetFile",
    "export_subset",
    "finetune_subset",
    "load_subset",
    "merge_subset",
    "read_examples",
    "save_subset",
    "select_subset",
]
