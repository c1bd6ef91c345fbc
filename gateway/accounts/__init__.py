"""Keys, teams, quotas and money: who calls, what they may spend, what they spent."""
