"""A training script written against vLLM's own trainer API, as vLLM documents it, with one change: the
import that registers the gloo backend (and gives its init info). It pushes a Hugging Face model into the
replica at URL (the admin key in the URL: HTTP Basic) and prints `{"done": true}`.

    python tests/support/plain_vllm_trainer.py http://trainer:KEY@127.0.0.1:PORT CHECKPOINT_DIR
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

from sampler_client.weight_transfer import GlooTrainerInitInfo  # the one line this project adds

url, checkpoint = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
engine = WeightTransferTrainerFactory.trainer_init(
    GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0),
    client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
engine.send_weights()
engine.shutdown()
print(json.dumps({"done": True}))
