"""The texts ``attnchat cache-eval`` reads: a long everyday conversation to hide needles in, the
needles, and a held-out text whose continuation is scored.

Written for this benchmark (no download, the same on every machine). The filler turns are
ordinary questions and answers with no numbers in them, so a code in a needle is the only
one of its kind; the held-out text is a plain essay on a different subject.
"""
from __future__ import annotations

#: (user, assistant) exchanges; a conversation takes as many as it needs, in a seeded order.
FILLER = (
    ("How do I keep basil alive on a windowsill?",
     "Give it the sunniest window you have, water it when the top of the soil feels dry, and pinch off the "
     "flower buds as soon as they appear. Cutting the stems just above a pair of leaves makes the plant bushier."),
    ("What is a good way to start running if I have never done it?",
     "Begin with short intervals: run for a minute, walk for two, and repeat that for twenty minutes. Add a "
     "little running each week, keep the pace easy enough to talk, and rest between sessions."),
    ("Why does bread go stale?",
     "The starch in bread slowly crystallises again after baking and pushes water out, so the crumb turns firm "
     "and dry. Keeping bread in the fridge speeds this up; freezing it slows it almost to a stop."),
    ("Can you suggest a simple dinner with lentils?",
     "Soften an onion and some garlic in oil, stir in cumin and paprika, then add red lentils, chopped tomatoes "
     "and water. Let it simmer until thick, season with salt and lemon, and serve it with rice or flatbread."),
    ("How do bees make honey?",
     "Worker bees drink nectar from flowers and carry it back to the hive, where other bees pass it from mouth "
     "to mouth and spread it in the comb. Fanning wings dry it until it thickens, and then they cap each cell with wax."),
    ("What should I pack for a weekend of hiking?",
     "Pack layers you can add or remove, a rain jacket, sturdy shoes, plenty of water, snacks, a map, a small "
     "first aid kit, sun cream and a torch. Tell someone where you are going and when you expect to be back."),
    ("Why is the sky blue?",
     "Sunlight holds every colour, and the air scatters the short blue waves far more than the long red ones. "
     "That scattered blue light reaches your eyes from every part of the sky, so the whole dome looks blue."),
    ("How can I learn to draw faces?",
     "Start with the proportions: the eyes sit about halfway down the head, the nose halfway between the eyes "
     "and the chin. Draw from photographs, then from people, and copy the drawings of artists you admire."),
    ("What is the difference between weather and climate?",
     "Weather is what the air does today or this week: rain, wind, heat. Climate is the long pattern of that "
     "weather over decades, the kind of summers and winters a place usually has."),
    ("How do I remove a coffee stain from a shirt?",
     "Rinse the stain from the back with cold water as soon as you can, then rub in a little liquid soap and "
     "let it sit. Wash the shirt as usual and check the stain before drying, since heat can set it."),
    ("Why do cats purr?",
     "Cats purr when they are content, but also when they are hurt or anxious, so it seems to calm them. The "
     "sound comes from the muscles of the voice box twitching as the cat breathes in and out."),
    ("What makes a good cup of tea?",
     "Use fresh water, warm the pot first, and let black tea steep in boiling water for a few minutes. Green "
     "tea prefers cooler water and a shorter steep, or it turns bitter."),
    ("How do I stop procrastinating?",
     "Break the task into a first step so small it feels silly, set a timer for a short burst of work, and put "
     "your phone in another room. Finishing one small piece usually makes the next one easier to start."),
    ("How does a rainbow form?",
     "Sunlight enters falling raindrops, bends, reflects off the back of each drop and bends again on the way "
     "out. Each colour bends by a slightly different amount, so the light fans out into a band of colours."),
    ("What is a good houseplant for a dark room?",
     "A snake plant or a pothos copes well with little light and forgets you if you forget it. Water them only "
     "when the soil has dried out, and wipe the dust off their leaves now and then."),
    ("How should I store potatoes?",
     "Keep them somewhere cool, dark and dry, in a paper bag or a basket rather than plastic. Keep them away "
     "from onions, which make them sprout sooner, and out of the light, which turns them green."),
    ("Why do leaves change colour in autumn?",
     "As days shorten, trees stop making the green pigment that catches sunlight. The yellow and orange pigments "
     "that were there all along show through, and some trees also make new red ones."),
    ("How can I sleep better?",
     "Go to bed and get up at the same time every day, keep the bedroom dark and cool, and avoid screens and "
     "coffee in the evening. A short walk in daylight during the day helps as well."),
    ("What is the best way to learn a new language?",
     "Practise a little every day, listen to the language as much as you can, and speak it with people even "
     "when you make mistakes. Learn the most common words first and read simple stories."),
    ("How do birds know where to migrate?",
     "Birds use several clues together: the position of the sun and the stars, the earth's magnetic field, "
     "landmarks such as coasts and rivers, and in some species even smells."),
    ("How do I make my bicycle chain run smoothly?",
     "Wipe the chain clean with a rag, put a small drop of chain oil on each link while you turn the pedals "
     "backwards, and then wipe off the extra oil so it does not collect dirt."),
    ("Why does the moon change shape?",
     "The moon is always half lit by the sun. As it travels around the earth we see different amounts of the "
     "lit half, from none at new moon to all of it at full moon."),
    ("What is a gentle way to wake up in the morning?",
     "Open the curtains as soon as you wake so daylight reaches you, drink a glass of water, and move a little, "
     "even just a stretch. An alarm with a soft, rising sound is kinder than a loud buzz."),
    ("How do I write a polite complaint letter?",
     "Say plainly what happened and when, what you would like them to do about it, and keep the tone calm. "
     "Attach copies of receipts or photographs and keep a copy of the letter for yourself."),
)

#: (thing, code): one needle per trial, a user's turn asking the assistant to remember it.
NEEDLES = (
    ("locker", "4817"),
    ("garage door", "2093"),
    ("bike lock", "7561"),
    ("office safe", "3348"),
)


def needle_turn(thing: str, code: str) -> tuple[str, str]:
    """The (user, assistant) exchange that states a needle."""
    return (f"Please remember this for me: the code for my {thing} is {code}.",
            f"Of course, I will remember the code for your {thing}.")


def question(thing: str) -> tuple[str, str]:
    """The last user message and the start of the reply the model continues."""
    return f"What is the code for my {thing}?", f"The code for your {thing} is"


#: The held-out text: its first part is read into the cache, the continuation is scored.
HELD_OUT = (
    "The history of the lighthouse is a history of people trying to make the sea a little less dangerous. "
    "Long before there were towers, sailors steered by fires lit on hilltops near harbours, and the keepers of "
    "those fires were often paid by the ships that came in safely. The most famous early light stood at the "
    "entrance to the harbour of Alexandria. It was so tall that travellers described it for centuries after it "
    "fell, and its name became the word for lighthouse in several languages. For a long time afterwards, most "
    "lights were simple: a fire of wood or coal burning in an open iron basket at the top of a stone tower. Such "
    "fires were smoky, hard to keep going in a storm, and not very bright, and a ship could mistake one for a "
    "cottage window or a fire on the shore.\n\n"
    "Two problems shaped every improvement that followed: how to make a brighter light, and how to send that "
    "light out towards the sea instead of up into the sky. Candles in glass lanterns were cleaner than open "
    "fires but gave little light. Oil lamps with hollow wicks, which drew air through the flame, burned far more "
    "brightly and with less smoke, and keepers soon learned to trim the wicks and polish the glass through the "
    "night. Curved mirrors placed behind the lamps gathered the light that would otherwise be lost and threw it "
    "forward in a beam. The mirrors had to be polished constantly, and salt and soot dulled them quickly, so a "
    "keeper's night was long and busy.\n\n"
    "The great change came with the lens designed by a French engineer in the early nineteenth century. Instead "
    "of one thick piece of glass, which would have been too heavy and would have cracked, he built the lens from "
    "rings of glass prisms arranged around a central bull's eye. Each ring bent the light from the lamp into a "
    "flat beam, and the prisms at the top and bottom caught light that would otherwise have escaped upwards and "
    "downwards. A lighthouse fitted with such a lens could be seen many miles farther out than one with mirrors, "
    "and it used far less oil. Lenses were made in several sizes, called orders, from the largest for dangerous "
    "coasts to small ones for harbours and rivers.\n\n"
    "Sailors needed to know not only that a light was there but which light it was. A coast with many towers "
    "could be as confusing as a coast with none. So each lighthouse was given its own character: a steady light, "
    "a light that flashed once every few seconds, a group of flashes, or a light that turned off briefly at "
    "regular intervals. Turning the lens on a bed of rollers, or later floating it on a bath of mercury, made the "
    "beams sweep round the horizon, and a ship's officer with a watch could count the flashes and look them up "
    "in a printed list. Towers were also painted in stripes, bands or checks so that they could be told apart "
    "by day.\n\n"
    "The life of a keeper was one of routine and patience. The lamp had to be lit at sunset and put out at "
    "sunrise, the wicks trimmed, the oil carried up the winding stairs, the lens cleaned of every fingerprint, "
    "and the log written up each morning. On rock towers far out at sea, keepers lived for weeks at a time in "
    "small round rooms stacked one above another, with the kitchen at the bottom, the bedrooms in the middle, and "
    "the lamp at the top. Storms could cut them off for long periods, and the relief boat sometimes waited days "
    "for the sea to calm before it could come close enough to land supplies. Many keepers kept gardens where "
    "there was soil, raised chickens, and taught their children at home.\n\n"
    "Fog was the keeper's worst enemy, because even the brightest light could vanish a short way from the "
    "tower. Bells were rung by hand or by clockwork, and later great horns and sirens driven by compressed air "
    "sounded a pattern of blasts that, like the flashes of the light, told sailors which station they were "
    "hearing. Sound carries strangely over water in fog, however, and a ship could hear a horn clearly at one "
    "distance and not at all closer in, so captains were taught to treat these signals with caution.\n\n"
    "In the twentieth century electricity replaced oil, first in lamps and then in the motors that turned the "
    "lenses. Radio beacons allowed ships to find their direction from stations far beyond the range of any "
    "light, and later satellite navigation told a ship its position anywhere on earth. One by one the towers "
    "were automated, their lights switched on and off by sensors and checked from a distant office, and the last "
    "keepers left their stations. Some of the old lenses were taken down and put in museums, and many towers "
    "were opened to visitors who climb the stairs to look out over the water.\n\n"
    "Yet the lights are still kept burning on many coasts. Electronic systems can fail, and a small boat may have "
    "no more than a compass and a chart, so a light on a headland remains a simple and reliable sign. Sailors "
    "returning from a long passage often say that the first sight of a familiar light, flashing its own pattern "
    "on the horizon, is the moment they know they are nearly home. The towers that once depended on the care of "
    "a keeper through every night of the year now mostly look after themselves, but they still do the same work "
    "they have always done: they show the way in, and they warn of the rocks that lie in wait."
)
