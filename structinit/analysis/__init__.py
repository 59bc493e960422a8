"""Quality measures of attention (one record for every solution, model or checkpoint), as text and as figures."""
