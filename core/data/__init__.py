"""Data: prompt sources (`SourceSpec`) and SFT pairs."""
