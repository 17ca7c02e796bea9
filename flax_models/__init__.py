"""Model zoo: BERT, GPT, encoder-decoder Transformer and ViT, each with a plain-Flax twin."""
