"""Text as people have it, to token files a language model trains on."""
