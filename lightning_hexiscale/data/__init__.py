"""Data: each pipeline's slice of every global batch, token datasets and tokenisation, Hugging Face
weights in (safetensors) and out."""

from lightning_hexiscale.data.datasets import (BYTE_VOCAB, TokenFileDataset, TokenWindows, byte_detokenize,
                                               byte_tokenize, generated_corpus, generated_text, make_dataset,
                                               text_file_dataset)
from lightning_hexiscale.data.samplers import (PlanBatchSampler, PlanDataLoader, loader_shuffles, plan_dataloader,
                                               split_proportional)
from lightning_hexiscale.data.weights import HFWeights, attach_weights, load_hf

__all__ = ["BYTE_VOCAB", "HFWeights", "PlanBatchSampler", "PlanDataLoader", "TokenFileDataset", "TokenWindows",
           "attach_weights", "byte_detokenize", "byte_tokenize", "generated_corpus", "generated_text", "load_hf",
           "loader_shuffles", "make_dataset", "plan_dataloader", "split_proportional", "text_file_dataset"]
