"""Images, video and audio from the dataset to the loss (docs/multimodal.md).

`items` holds the canonical media types every layer passes around; `sources` and `decode` turn a
dataset cell into them; `canonical` fits them to a model's patch grid once, at load time;
`families` / `processor` / `positions` build a model's inputs from them.
"""
