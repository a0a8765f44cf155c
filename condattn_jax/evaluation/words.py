"""Offline word lists for the text tasks (RULER draws adjective-noun keys from the `wonderwords`
package and CWE words from an English word list; these short built-in lists stand in for them:
80 adjectives x 80 nouns = 6400 distinct 'adjective-noun' keys, no download)."""

ADJECTIVES = tuple("""
able acid angry amber ancient brave bright broad calm cheap clean clever cold cool crisp curly
damp dark deep dusty eager early empty even faint fancy fierce flat fresh gentle giant glad
golden grand green happy heavy hollow humble icy jolly keen kind large late lazy light little
lively loud lucky mellow mighty misty modern narrow neat noble odd orange pale plain polite
proud quick quiet rapid rare rich rough round rusty sharp shiny silent silver simple sleepy slow smooth
""".split())

NOUNS = tuple("""
anchor apple arrow badge basket beach bell berry blade boat bottle bridge brush cabin candle
canyon castle cherry cloud comet coral crane crown desert dragon drum eagle engine falcon
feather fern forest fountain garden glacier harbor helmet hill island jacket jungle kettle
ladder lagoon lantern lemon magnet maple marble meadow mirror monkey mountain needle ocean
orchid otter palace parrot pebble pepper piano planet pocket quartz rabbit river rocket saddle
sail shell shield silk spoon star stone storm temple tiger tower
""".split())

# Common English words for common-word extraction (RULER: english_words.json).
COMMON_WORDS = tuple("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy
process music market sense nation plan college interest death experience effect use class
control care field development role effort rate heart drug show leader light voice wife
police mind price report decision son view relationship town road arm difference value
""".split())

assert len(ADJECTIVES) == 80 and len(NOUNS) == 80, (len(ADJECTIVES), len(NOUNS))
assert len(set(COMMON_WORDS)) == len(COMMON_WORDS)
