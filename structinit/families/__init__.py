"""The built-in model families, one adapter module each (:mod:`structinit.init.family` holds the
contract and the registry, which loads these by name):

==============================  =====================================================================
module                          family
==============================  =====================================================================
``families.structinit_models``  structinit's own models (``train``'s presets) and their run checkpoints
``families.timm_vit``           timm ViTs and their checkpoints (timm's train.py ones included)
``families.hf_vit``             Hugging Face ViT/DeiT
``families.hf_bert``            Hugging Face BERT-style encoders (token ids)
``families.hf_gpt2``            Hugging Face GPT-2 (token ids, causal)
``families.torch_mha``          ``nn.MultiheadAttention`` (no model built)
``families.hf_common``          what the Hugging Face families share: the model built by transformers
``families.weights``            a checkpoint's weights loaded into the model its family built
==============================  =====================================================================
"""
