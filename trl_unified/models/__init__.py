"""The bottom layer: loading models and processors (PEFT, k-bit, MoE settings) and token ids against an embedding
table. Every other subpackage may import it; it imports none of them."""
