"""Model families (one file each) behind the ModelFamily seam of family.py, plus checkpoint loading."""
