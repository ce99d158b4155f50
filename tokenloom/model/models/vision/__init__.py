"""Vision encoders of the vision-language models: each turns preprocessed pixels into rows of the text
model's embedding width, one tensor per image, ready to replace that image's placeholder tokens.

- Qwen2.5-VL: `qwen2_5_vl_vision.Qwen2_5_VisionTower` (dynamic resolution, window attention, patch merger),
  its preprocessing `qwen2_5_vl_preprocess`, and the text model's 3-stream positions `mrope`.
- Gemma 3: `gemma3_vision.Gemma3VisionEncoder` (a SigLIP tower, `siglip`, and the pooling projector,
  `gemma3_projector`), its preprocessing `gemma3_preprocess`.

Parameter names are the checkpoints': each encoder's `CHECKPOINT_PREFIXES` lists the prefixes its tensors carry
in released files and in transformers 5 saves, and `checkpoint_names.load_encoder_weights` fills it from them.
"""
