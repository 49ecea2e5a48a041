"""Checkpoints: where a job starts (start), DCP save/resume (checkpointer), Hugging Face
import/export (hf) and rank-0 file io."""
