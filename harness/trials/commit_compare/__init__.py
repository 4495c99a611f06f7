"""Today's code against an earlier commit's, on one machine in one run: every turn type, paired."""
