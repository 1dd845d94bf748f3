"""A small mixed prompt set that ships with draftsmith, for calibrating what a drafter is expected to accept.

Why not the training run's held-out split: it is the training distribution (ShareGPT first turns in the demo), which
prompt lookup and the drafter find easier than users' prompts, and an expectation calibrated there promised far more
than MT-bench then measured. Why not an evaluation set: what is reported on must never be what is tuned on. These
prompts were written for this purpose: they are neither in ShareGPT nor in MT-bench or HumanEval (a test checks the
installed evaluation sets), and they spread across the kinds of request a user sends (writing, role play,
reasoning, maths, code, extraction from a pasted text, science, humanities), short and long, so that the target's
own answers to them are text of every kind a drafter meets.
"""

from __future__ import annotations

#: (category, prompt). Order is fixed: calibration decodes a prefix of it (``CALIBRATION_LIMIT``), so every category
#: comes once before any comes twice.
MIXED_PROMPTS: tuple[tuple[str, str], ...] = (
    ("writing", "Write a short, warm thank-you note to a neighbour who watered my plants while I was away for two "
                "weeks."),
    ("coding", "Write a Python function `chunk(items, size)` that splits a list into consecutive chunks of at most "
               "`size` items. Include type hints, a docstring, and two example calls with their output."),
    ("reasoning", "A train leaves at 14:10 and arrives at 17:45, with two stops of 12 minutes each. How long was it "
                  "actually moving? Explain your steps."),
    ("extraction", "From the notice below, list every date and what happens on it, as a bulleted list.\n\n"
                   "Library renovation notice: the reading room closes on 3 March for new shelving. Book returns "
                   "move to the side entrance from 5 March. The children's corner reopens on 21 March, and the "
                   "whole building reopens on 2 April with longer evening hours. A volunteer meeting about the "
                   "reopening event is planned for 28 March at 6 pm."),
    ("roleplay", "You are a tour guide in a small fishing town. Welcome a group of visitors and tell them what they "
                 "will see on a two-hour walk."),
    ("math", "Solve for x and check your answer: 3(x - 4) + 7 = 2x + 5."),
    ("stem", "Why does a metal spoon feel colder than a wooden spoon at the same room temperature?"),
    ("humanities", "Give a brief overview of why the printing press changed how ideas spread in Europe."),
    ("coding", "Explain what this SQL query returns, then rewrite it to also show customers with no orders:\n\n"
               "SELECT c.name, COUNT(o.id) AS orders\nFROM customers c\nJOIN orders o ON o.customer_id = c.id\n"
               "GROUP BY c.name\nORDER BY orders DESC;"),
    ("writing", "Rewrite this paragraph so that it is clearer and more concise:\n\n"
                "In the event that the meeting that was scheduled for Tuesday ends up being moved to a different "
                "day, which may or may not happen depending on the availability of the room, we will make sure to "
                "let everyone who is involved know about the change as soon as it is possible for us to do so."),
    ("extraction", "Turn these notes into a JSON object with the keys name, role, start_date and skills:\n\n"
                   "Maria Lopez joins as a data analyst on 9 June. She knows SQL, Python and dashboard design, "
                   "and has some experience with forecasting."),
    ("reasoning", "I have a 3-litre jug and a 5-litre jug and unlimited water. How can I measure exactly 4 litres? "
                  "List the steps."),
    ("stem", "Describe the main stages of the water cycle in a few sentences each."),
    ("humanities", "What are two arguments for and two against making museums free to enter?"),
    ("math", "A shop raises a price by 20% and later lowers the new price by 20%. Is the final price higher, lower "
             "or the same as the original? Show the calculation."),
    ("roleplay", "Pretend you are a friendly librarian helping a teenager choose a first science-fiction novel. Ask "
                 "one question and then make two suggestions."),
)


def mixed_prompts(limit: int | None = None) -> list[str]:
    """The prompts' texts, the first ``limit`` of them (every category once before any twice)."""
    return [text for _, text in MIXED_PROMPTS[:limit]]
