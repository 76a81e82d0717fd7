"""The pipeline of one worker: stages assembled into packed token blocks (PackedTokenDataset), the batch contract, evaluation."""
