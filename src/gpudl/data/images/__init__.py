"""Images: held in memory, or a folder streamed, decoded and augmented."""
