"""Images into a prompt, on the frontend's side (numpy and Pillow, never torch): decoding with limits
(`image_decode`), where images come from (`image_source`), the CLIP preprocessing LLaVA uses
(`clip_preprocess`), content hashes (`image_hash`), placeholder expansion (`placeholders`), and the model's
processor that ties them together (`processor`).
"""
